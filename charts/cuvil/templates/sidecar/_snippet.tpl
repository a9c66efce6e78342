{{/*
The sidecar container and volumes to add to an app pod (printed by NOTES.txt, copied into the
chart README). The app talks to localhost:<grpcPort> with any Open Inference Protocol v2 client.
*/}}
{{- define "cuvil.sidecar.snippet" -}}
{{- $s := .Values.sidecar }}
{{- $registrySecret := include "cuvil.registry.secretName" . }}
spec:
  securityContext:
    runAsNonRoot: true
    seccompProfile:
      type: RuntimeDefault
  containers:
    # - name: app ...  (your container: OIP v2 gRPC on localhost:{{ $s.grpcPort }})
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
    {{- if and $registrySecret $s.useRegistrySecret }}
    - name: cuvil-registry
      secret:
        secretName: {{ $registrySecret }}
        items:
          - key: .dockerconfigjson
            path: config.json
    {{- end }}
{{- end }}
