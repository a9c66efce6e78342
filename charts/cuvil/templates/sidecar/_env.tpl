{{/*
The sidecar's settings as a YAML mapping (variable: value): the ConfigMap's data, and what the
injection webhook gives every sidecar it adds (CUVIL_INJECT_ENV). Pull credentials and the
model are per pod, so they are not here.
*/}}
{{- define "cuvil.sidecar.env" -}}
{{- $s := .Values.sidecar -}}
CUVIL_GRPC_PORT: {{ $s.grpcPort | quote }}
CUVIL_GRPC_FRONTEND: {{ $s.grpcFrontend | quote }}
CUVIL_METRICS_PORT: {{ $s.metricsPort | quote }}
CUVIL_CACHE_DIR: {{ $s.cacheDir | quote }}
CUVIL_CACHE_MAX_BYTES: {{ $s.cacheMaxBytes | int64 | quote }}
CUVIL_MAX_BATCH_SIZE: {{ $s.maxBatchSize | quote }}
CUVIL_MAX_QUEUE_DELAY_US: {{ $s.maxQueueDelayUs | quote }}
CUVIL_LONE_REQUESTS: {{ $s.loneRequests | quote }}
CUVIL_MODEL_INSTANCES: {{ $s.modelInstances | quote }}
CUVIL_POLL_INTERVAL_S: {{ $s.pollIntervalSeconds | quote }}
CUVIL_TORCH_THREADS: {{ $s.torchThreads | quote }}
CUVIL_SHARED_MEMORY: {{ $s.sharedMemory.mode | quote }}
{{- with $s.warmupShapes }}
CUVIL_WARMUP_SHAPES: {{ . | quote }}
{{- end }}
{{- if .Values.registry.plainHttp }}
CUVIL_REGISTRY_PLAIN_HTTP: "1"
{{- end }}
{{- range (include "cuvil.otelEnv" (list . "cuvil-sidecar") | fromYamlArray) }}
{{ .name }}: {{ .value | quote }}
{{- end }}
{{- end }}
