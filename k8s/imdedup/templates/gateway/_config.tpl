{{/* The gateway ConfigMap's data, also hashed into its pods' checksum/config annotation. */}}
{{- define "imdedup.gateway.configData" -}}
IMDEDUP_GATEWAY_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.gateway.containerPorts.http) | quote }}
IMDEDUP_ADMIN_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.gateway.containerPorts.admin) | quote }}
# Derived from ingest.replicas; the ingest shards get the same list.
IMDEDUP_SHARDS: {{ include "imdedup.ingest.shards" . | quote }}
IMDEDUP_STORAGE_URL: {{ include "imdedup.storage.url" . | quote }}
IMDEDUP_SEND_TIMEOUT: {{ .Values.gateway.config.sendTimeout | quote }}
IMDEDUP_MAX_BODY_BYTES: {{ .Values.config.maxBodyBytes | quote }}
IMDEDUP_MAX_CONNECTIONS: {{ .Values.gateway.config.maxConnections | quote }}
IMDEDUP_MAX_IN_FLIGHT: {{ .Values.gateway.config.maxInFlight | quote }}
{{- with .Values.gateway.config.limits }}
IMDEDUP_UPGRADE_TIMEOUT: {{ .upgradeTimeout | quote }}
IMDEDUP_MAX_UNAUTHENTICATED: {{ .maxUnauthenticated | int64 | quote }}
IMDEDUP_PING_INTERVAL: {{ .pingInterval | quote }}
IMDEDUP_IDLE_TIMEOUT: {{ .idleTimeout | quote }}
IMDEDUP_MAX_CONNECTIONS_PER_USER: {{ .maxConnectionsPerUser | int64 | quote }}
IMDEDUP_USER_SENDS_PER_SECOND: {{ .userSendsPerSecond | int64 | quote }}
IMDEDUP_USER_SEND_BURST: {{ .userSendBurst | int64 | quote }}
IMDEDUP_MAX_SENDS_IN_FLIGHT: {{ .maxSendsInFlight | int64 | quote }}
IMDEDUP_MAX_HELD_BYTES: {{ .maxHeldBytes | int64 | quote }}
IMDEDUP_MAX_HISTORY_PAGE_BYTES: {{ .maxHistoryPageBytes | int64 | quote }}
IMDEDUP_MAX_PULLS_PER_CONNECTION: {{ .maxPullsPerConnection | int64 | quote }}
{{- end }}
IMDEDUP_GRACE: {{ printf "%ds" (int .Values.config.graceSeconds) | quote }}
IMDEDUP_AUTHZ: {{ .Values.gateway.authz.mode | quote }}
{{- if .Values.gateway.authz.groups }}
IMDEDUP_GROUPS_FILE: "/etc/imdedup/groups/groups.json"
{{- end }}
{{- with .Values.gateway.authz.membershipUrl }}
IMDEDUP_MEMBERSHIP_URL: {{ . | quote }}
{{- end }}
{{- with .Values.gateway.business.grpcPort }}
{{- if not $.Values.gateway.business.existingSecret }}
{{- fail "gateway.business.grpcPort serves the business API, which needs service tokens: give gateway.business.existingSecret" }}
{{- end }}
IMDEDUP_BUSINESS_GRPC_LISTEN: {{ printf "%s:%d" $.Values.config.listenHost (int .) | quote }}
{{- end }}
{{- with .Values.gateway.workerThreads }}
TOKIO_WORKER_THREADS: {{ . | int | quote }}
{{- end }}
{{- include "imdedup.tls.configData" (list . "gateway") }}
{{- include "imdedup.commonEnv" . }}
{{- end -}}
