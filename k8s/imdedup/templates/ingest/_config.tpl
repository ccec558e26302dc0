{{/* The ingest ConfigMap's data, also hashed into its pods' checksum/config annotation. */}}
{{- define "imdedup.ingest.configData" -}}
IMDEDUP_INGEST_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.ingest.containerPorts.grpc) | quote }}
IMDEDUP_ADMIN_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.ingest.containerPorts.admin) | quote }}
# Derived from ingest.replicas, the same list as the gateways': a shard
# refuses (retryably) a conversation the list gives to another shard.
IMDEDUP_SHARDS: {{ include "imdedup.ingest.shards" . | quote }}
{{- if not (include "imdedup.scyllaMode" .) }}
IMDEDUP_STORAGE_URL: {{ include "imdedup.storage.url" . | quote }}
{{- end }}
IMDEDUP_WINDOW_TTL: {{ .Values.ingest.config.windowTtl | quote }}
IMDEDUP_CLAIM_TTL: {{ .Values.ingest.config.claimTtl | quote }}
IMDEDUP_WINDOW_MAX_KEYS: {{ .Values.ingest.config.windowMaxKeys | int64 | quote }}
IMDEDUP_STORAGE_TIMEOUT: {{ .Values.ingest.config.storageTimeout | quote }}
{{- with .Values.ingest.config.overload }}
{{- if or (gt (int64 .dbConcurrencyMin) (int64 .dbConcurrencyInitial)) (gt (int64 .dbConcurrencyInitial) (int64 .dbConcurrencyMax)) }}
{{- fail (printf "ingest.config.overload: give dbConcurrencyMin <= dbConcurrencyInitial <= dbConcurrencyMax (got %d, %d, %d)" (int64 .dbConcurrencyMin) (int64 .dbConcurrencyInitial) (int64 .dbConcurrencyMax)) }}
{{- end }}
IMDEDUP_DB_CONCURRENCY_INITIAL: {{ .dbConcurrencyInitial | int64 | quote }}
IMDEDUP_DB_CONCURRENCY_MIN: {{ .dbConcurrencyMin | int64 | quote }}
IMDEDUP_DB_CONCURRENCY_MAX: {{ .dbConcurrencyMax | int64 | quote }}
IMDEDUP_DB_SLOW_INSERT: {{ .dbSlowInsert | quote }}
IMDEDUP_DB_QUEUE_WAIT: {{ .dbQueueWait | quote }}
{{- end }}
IMDEDUP_MAX_BODY_BYTES: {{ .Values.config.maxBodyBytes | quote }}
IMDEDUP_GRACE: {{ printf "%ds" (int .Values.config.graceSeconds) | quote }}
{{- if include "imdedup.redisEnabled" . }}
{{- if .Values.redis.cluster }}
IMDEDUP_REDIS_CLUSTER: "true"
{{- end }}
IMDEDUP_REDIS_KEY_PREFIX: {{ .Values.redis.keyPrefix | quote }}
IMDEDUP_REDIS_TIMEOUT: {{ .Values.redis.timeout | quote }}
IMDEDUP_REDIS_WARMUP: {{ .Values.ingest.config.overload.redisWarmup | quote }}
{{- if .Values.redis.caSecret.name }}
IMDEDUP_REDIS_CA: {{ printf "/etc/imdedup/redis-ca/%s" .Values.redis.caSecret.key | quote }}
{{- end }}
{{- end }}
{{- with .Values.ingest.workerThreads }}
TOKIO_WORKER_THREADS: {{ . | int | quote }}
{{- end }}
{{- include "imdedup.tls.configData" (list . "ingest") }}
{{- include "imdedup.commonEnv" . }}
{{- end -}}
