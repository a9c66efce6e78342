{{/*
The operator's webhook settings (operator/cuvil_operator/webhook.py and injection.py): where it
listens, its certificate, and what every injected sidecar gets.
*/}}
{{- define "cuvil.operator.injectionEnv" -}}
{{- $inj := .Values.injection -}}
- name: CUVIL_WEBHOOK_LISTEN
  value: {{ printf "0.0.0.0:%v" $inj.port | quote }}
- name: CUVIL_WEBHOOK_CERT_DIR
  value: /etc/cuvil/webhook
- name: CUVIL_INJECT_IMAGE
  value: {{ include "cuvil.image" (list . .Values.sidecar.image) | quote }}
- name: CUVIL_INJECT_ENV
  value: {{ include "cuvil.sidecar.env" . | fromYaml | toJson | quote }}
- name: CUVIL_INJECT_SHM_SIZE
  value: {{ .Values.sidecar.sharedMemory.sizeLimit | quote }}
- name: CUVIL_INJECT_UNSERVED
  value: {{ $inj.unservedModel | quote }}
{{- with $inj.cacheHostPath }}
- name: CUVIL_INJECT_CACHE_HOST_PATH
  value: {{ . | quote }}
{{- end }}
{{- with .Values.sidecar.trust.publicKeysConfigMap }}
- name: CUVIL_INJECT_TRUSTED_KEYS
  value: {{ . | quote }}
{{- end }}
{{- with $inj.registrySecret }}
- name: CUVIL_INJECT_REGISTRY_SECRET
  value: {{ . | quote }}
{{- end }}
{{- /* the sidecar's TLS and token Secrets, mounted from each injected pod's namespace */}}
{{- $s := .Values.sidecar }}
{{- if or $s.tls.existingSecret $s.auth.tokensSecret }}
{{- if not $s.metricsPort }}
{{- fail "sidecar.tls / sidecar.auth with injection need sidecar.metricsPort: the kubelet probes it (plaintext, no token)" }}
{{- end }}
{{- end }}
{{- with $s.tls.existingSecret }}
- name: CUVIL_INJECT_TLS_SECRET
  value: {{ . | quote }}
- name: CUVIL_INJECT_TLS_CLIENT_CA
  value: {{ ternary "true" "false" $s.tls.clientCA | quote }}
{{- end }}
{{- with $s.auth.tokensSecret }}
{{- if eq $s.auth.health "required" }}
{{- fail "sidecar.auth.health=required fails the kubelet's probes of injected sidecars (they carry no token)" }}
{{- end }}
- name: CUVIL_INJECT_TOKENS_SECRET
  value: {{ . | quote }}
{{- end }}
{{- end }}
