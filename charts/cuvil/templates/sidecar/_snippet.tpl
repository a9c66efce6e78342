{{/*
The sidecar container and volumes to add to an app pod (printed by NOTES.txt, copied into the
chart README). The app talks to localhost:<grpcPort> (gRPC) or <httpPort> (REST) with any Open
Inference Protocol v2 client; with tls.existingSecret over TLS, with auth.tokensSecret with a
bearer token.
*/}}
{{- define "cuvil.sidecar.snippet" -}}
{{- $s := .Values.sidecar }}
{{- $registrySecret := include "cuvil.registry.secretName" . }}
spec:
  # the sidecar drains calls and streams for CUVIL_EXIT_TIMEOUT_S after SIGTERM: keep this above
  terminationGracePeriodSeconds: {{ max 30 (add (ceil $s.exitTimeoutSeconds) 10) }}
  securityContext:
    runAsNonRoot: true
    seccompProfile:
      type: RuntimeDefault
  containers:
    # - name: app ...  (your container: OIP v2 gRPC on localhost:{{ $s.grpcPort }}{{ if $s.httpPort }}, REST on :{{ $s.httpPort }}{{ end }})
    {{- if eq $s.sharedMemory.mode "system" }}
    #   volumeMounts: [{name: cuvil-shm, mountPath: /dev/shm}]  (tensors via shared memory)
    {{- end }}
    - name: cuvil-sidecar
      image: {{ include "cuvil.image" (list . $s.image) }}
      envFrom:
        - configMapRef:
            name: {{ include "cuvil.componentName" (list . "sidecar") }}
      env:
        # the artifact, pinned by digest: kubectl get mc NAME -o jsonpath='{.status.promoted.ref}'
        - name: CUVIL_MODEL
          value: registry.example.com/models/minilm@sha256:<digest>
      ports:
        - name: oip-grpc
          containerPort: {{ $s.grpcPort }}
        {{- if $s.httpPort }}
        - name: oip-http
          containerPort: {{ $s.httpPort }}
        {{- end }}
        - name: metrics
          containerPort: {{ $s.metricsPort }}
      startupProbe:
        httpGet:
          path: /v2/health/ready
          port: metrics
        periodSeconds: 5
        failureThreshold: 120
      readinessProbe:
        httpGet:
          path: /v2/health/ready
          port: metrics
      livenessProbe:
        httpGet:
          path: /v2/health/live
          port: metrics
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: cuvil-cache
          mountPath: {{ $s.cacheDir }}
        - name: cuvil-tmp
          mountPath: /tmp
        {{- if eq $s.sharedMemory.mode "system" }}
        - name: cuvil-shm
          mountPath: /dev/shm
        {{- end }}
        {{- if and $registrySecret $s.useRegistrySecret }}
        - name: cuvil-registry
          mountPath: /etc/cuvil/registry
          readOnly: true
        {{- end }}
        {{- if $s.tls.existingSecret }}
        - name: cuvil-tls
          mountPath: /etc/cuvil/tls
          readOnly: true
        {{- end }}
        {{- if $s.auth.tokensSecret }}
        - name: cuvil-auth
          mountPath: /etc/cuvil/auth
          readOnly: true
        {{- end }}
        {{- if $s.trust.publicKeysConfigMap }}
        - name: cuvil-trust
          mountPath: /etc/cuvil/trust
          readOnly: true
        {{- end }}
  volumes:
    - name: cuvil-cache
      emptyDir: {}
    - name: cuvil-tmp
      emptyDir: {}
    {{- if eq $s.sharedMemory.mode "system" }}
    - name: cuvil-shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $s.sharedMemory.sizeLimit }}
    {{- end }}
    {{- if $s.trust.publicKeysConfigMap }}
    - name: cuvil-trust
      configMap:
        name: {{ $s.trust.publicKeysConfigMap }}
    {{- end }}
    {{- if and $registrySecret $s.useRegistrySecret }}
    - name: cuvil-registry
      secret:
        secretName: {{ $registrySecret }}
        items:
          - key: .dockerconfigjson
            path: config.json
    {{- end }}
    {{- if $s.tls.existingSecret }}
    - name: cuvil-tls
      secret:
        secretName: {{ $s.tls.existingSecret }}
    {{- end }}
    {{- if $s.auth.tokensSecret }}
    - name: cuvil-auth
      secret:
        secretName: {{ $s.auth.tokensSecret }}
        items:
          - key: tokens
            path: tokens
    {{- end }}
{{- end }}
