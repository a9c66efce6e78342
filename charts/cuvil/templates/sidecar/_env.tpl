{{/*
The sidecar's settings as a YAML mapping (variable: value): the ConfigMap's data, and what the
injection webhook gives every sidecar it adds (CUVIL_INJECT_ENV). The model, pull credentials,
TLS, tokens and trusted keys are files mounted per pod, so they are not here.
*/}}
{{- define "cuvil.sidecar.env" -}}
{{- $s := .Values.sidecar -}}
CUVIL_GRPC_PORT: {{ $s.grpcPort | quote }}
CUVIL_GRPC_FRONTEND: {{ $s.grpcFrontend | quote }}
CUVIL_METRICS_PORT: {{ $s.metricsPort | quote }}
CUVIL_HTTP_PORT: {{ $s.httpPort | quote }}
CUVIL_MAX_QUEUE_SIZE: {{ $s.maxQueueSize | quote }}
CUVIL_QUEUE_TIMEOUT_US: {{ $s.queueTimeoutUs | quote }}
CUVIL_RATE_LIMIT: {{ $s.rateLimit | quote }}
CUVIL_RATE_BURST: {{ $s.rateBurst | quote }}
CUVIL_CACHE_DIR: {{ $s.cacheDir | quote }}
CUVIL_CACHE_MAX_BYTES: {{ $s.cacheMaxBytes | int64 | quote }}
CUVIL_MAX_BATCH_SIZE: {{ $s.maxBatchSize | quote }}
CUVIL_MAX_QUEUE_DELAY_US: {{ $s.maxQueueDelayUs | quote }}
CUVIL_LONE_REQUESTS: {{ $s.loneRequests | quote }}
CUVIL_MODEL_INSTANCES: {{ $s.modelInstances | quote }}
CUVIL_POLL_INTERVAL_S: {{ $s.pollIntervalSeconds | quote }}
CUVIL_TORCH_THREADS: {{ $s.torchThreads | quote }}
CUVIL_SHARED_MEMORY: {{ $s.sharedMemory.mode | quote }}
CUVIL_LOAD_TIMEOUT_S: {{ $s.loadTimeoutSeconds | quote }}
CUVIL_EXIT_TIMEOUT_S: {{ $s.exitTimeoutSeconds | quote }}
{{- with $s.generation }}
CUVIL_GENERATION_SLOTS: {{ .slots | quote }}
CUVIL_GENERATION_MAX_SEQ: {{ .maxSeq | quote }}
CUVIL_KV_CACHE_BYTES: {{ .kvCacheBytes | int64 | quote }}
CUVIL_GENERATION_MAX_WAITING: {{ .maxWaiting | quote }}
CUVIL_PREFILL_CHUNK: {{ .prefillChunk | quote }}
CUVIL_GENERATION_THREADS: {{ .threads | quote }}
CUVIL_PREFILL_ALONGSIDE: {{ .prefillAlongside | quote }}
CUVIL_PREFIX_REUSE: {{ .prefixReuse | quote }}
CUVIL_STREAM_INTERVAL: {{ .streamInterval | quote }}
{{- end }}
CUVIL_MAX_TENSOR_BYTES: {{ $s.maxTensorBytes | int64 | quote }}
CUVIL_TRUST_POLICY: {{ $s.trust.policy | quote }}
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
