{{/* The storage ConfigMap's data, also hashed into its pods' checksum/config annotation. */}}
{{- define "imdedup.storage.configData" -}}
IMDEDUP_STORAGE_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.storage.containerPorts.grpc) | quote }}
IMDEDUP_ADMIN_LISTEN: {{ printf "%s:%d" .Values.config.listenHost (int .Values.storage.containerPorts.admin) | quote }}
{{- if not (include "imdedup.scyllaMode" .) }}
IMDEDUP_DATA_DIR: {{ .Values.storage.persistence.mountPath | quote }}
IMDEDUP_STORAGE_MAX_BATCH: {{ .Values.storage.config.maxBatch | quote }}
IMDEDUP_STORAGE_COMMIT_DELAY: {{ .Values.storage.config.commitDelay | quote }}
{{- end }}
IMDEDUP_GRACE: {{ printf "%ds" (int .Values.config.graceSeconds) | quote }}
{{- include "imdedup.tls.configData" (list . "storage") }}
{{- include "imdedup.commonEnv" . }}
{{- end -}}
