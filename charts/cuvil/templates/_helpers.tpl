{{/* Names: Kubernetes names stop at 63 characters. */}}
{{- define "cuvil.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cuvil.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>", cut so that the whole stays within 63 characters. */}}
{{- define "cuvil.componentName" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $prefix := include "cuvil.fullname" $root | trunc (int (sub 62 (len $component))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $component }}
{{- end }}

{{- define "cuvil.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels; call with (list $ "component"). */}}
{{- define "cuvil.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "cuvil.chart" $root }}
{{ include "cuvil.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: cuvil
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "cuvil.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "cuvil.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* "repository:tag" or "repository@digest"; call with (list $ .Values.x.image). */}}
{{- define "cuvil.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{- define "cuvil.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "cuvil.componentName" (list . "operator")) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cuvil.worker.serviceAccountName" -}}
{{- if .Values.workers.serviceAccount.create }}
{{- default (include "cuvil.componentName" (list . "worker")) .Values.workers.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.workers.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secure defaults shared by every pod and container. */}}
{{- define "cuvil.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "cuvil.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext }}
{{- end }}

{{/* Redis: the Service host of the in-chart Redis, and the Secret with its password. */}}
{{- define "cuvil.redis.fullname" -}}
{{- include "cuvil.componentName" (list . "redis") }}
{{- end }}

{{- define "cuvil.redis.passwordSecret" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.enabled }}
{{- default (include "cuvil.redis.fullname" .) .Values.redis.auth.existingSecret }}
{{- end }}
{{- else }}
{{- .Values.externalRedis.existingSecret }}
{{- end }}
{{- end }}

{{- define "cuvil.redis.passwordKey" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretPasswordKey }}{{ else }}password{{ end }}
{{- else }}
{{- .Values.externalRedis.existingSecretPasswordKey }}
{{- end }}
{{- end }}

{{/* A Redis URL for one database; the password comes from $(CUVIL_REDIS_PASSWORD) at run time. */}}
{{- define "cuvil.redis.url" -}}
{{- $root := index . 0 }}
{{- $db := index . 1 }}
{{- $auth := ternary "" ":$(CUVIL_REDIS_PASSWORD)@" (empty (include "cuvil.redis.passwordSecret" $root)) }}
{{- if $root.Values.redis.enabled }}
{{- printf "redis://%s%s.%s.svc:6379/%v" $auth (include "cuvil.redis.fullname" $root) $root.Release.Namespace $db }}
{{- else }}
{{- $url := urlParse $root.Values.externalRedis.url }}
{{- printf "%s://%s%s/%v" $url.scheme $auth $url.host $db }}
{{- end }}
{{- end }}

{{/* Environment shared by the operator and the workers: broker and results. */}}
{{- define "cuvil.brokerEnv" -}}
{{- $secret := include "cuvil.redis.passwordSecret" . }}
{{- if $secret }}
- name: CUVIL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "cuvil.redis.passwordKey" . }}
{{- end }}
{{- $brokerDb := ternary 0 .Values.externalRedis.brokerDatabase .Values.redis.enabled }}
{{- $resultDb := ternary 1 .Values.externalRedis.resultDatabase .Values.redis.enabled }}
- name: CUVIL_BROKER_URL
  value: {{ include "cuvil.redis.url" (list . $brokerDb) | quote }}
- name: CUVIL_RESULT_BACKEND
  value: {{ include "cuvil.redis.url" (list . $resultDb) | quote }}
{{- end }}

{{/* The artifact registry's docker config Secret (empty: none). */}}
{{- define "cuvil.registry.secretName" -}}
{{- if .Values.registry.existingSecret }}
{{- .Values.registry.existingSecret }}
{{- else if .Values.registry.credentials.create }}
{{- include "cuvil.componentName" (list . "registry") }}
{{- end }}
{{- end }}

{{/* Standard OTEL_* variables; call with (list $ "service-name"). */}}
{{- define "cuvil.otelEnv" -}}
{{- $root := index . 0 }}
{{- with $root.Values.otel }}
- name: OTEL_SERVICE_NAME
  value: {{ index $ 1 | quote }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: "none"
{{- end }}
{{- if .resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ .resourceAttributes | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Queues of one workers.queues entry: its targets' queues, then extraQueues, deduplicated. */}}
{{- define "cuvil.worker.queues" -}}
{{- $queues := list }}
{{- range .targets }}
{{- if hasPrefix "cpu" . }}
{{- $queues = append $queues "cuvil.cpu" }}
{{- else }}
{{- $queues = append $queues (printf "cuvil.cuda.%s" (trimPrefix "cuda-" .)) }}
{{- end }}
{{- end }}
{{- range .extraQueues }}
{{- $queues = append $queues . }}
{{- end }}
{{- $queues | uniq | join "," }}
{{- end }}


{{/* The Secret holding the webhook's tls.crt / tls.key (and ca.crt). */}}
{{- define "cuvil.webhook.tlsSecret" -}}
{{- .Values.injection.tls.existingSecret | default (printf "%s-tls" (include "cuvil.componentName" (list . "webhook"))) -}}
{{- end }}
