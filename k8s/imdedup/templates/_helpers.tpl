{{/*
Names, labels and the pieces shared by the templates.
*/}}

{{- define "imdedup.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's full name, truncated to 63 characters (a DNS label).
*/}}
{{- define "imdedup.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A component's name: `<fullname>-<component>`, with the full name cut to 43
characters so that every derived name stays a valid DNS label: the ingest
StatefulSet's controller-revision-hash label (`<name>-<10 chars>`) and pod
names (`<name>-<ordinal>`) within 63, `<name>-headless` within 63.
Usage: include "imdedup.componentName" (list . "ingest")
*/}}
{{- define "imdedup.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "imdedup.fullname" $root | trunc 43 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "imdedup.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "imdedup.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Standard labels. Usage: include "imdedup.labels" (list . "gateway"); an empty
component gives the release-wide labels.
*/}}
{{- define "imdedup.labels" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
helm.sh/chart: {{ include "imdedup.chart" $root }}
{{ include "imdedup.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Values.image.tag | default $root.Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: imdedup
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "imdedup.selectorLabels" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
app.kubernetes.io/name: {{ include "imdedup.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- if $component }}
app.kubernetes.io/component: {{ $component }}
{{- end }}
{{- end -}}

{{/*
metadata.annotations from commonAnnotations and extra ones.
Usage: include "imdedup.annotations" (list . $extra)
*/}}
{{- define "imdedup.annotations" -}}
{{- $root := index . 0 -}}
{{- $all := merge (dict) (index . 1 | default dict) $root.Values.commonAnnotations -}}
{{- if $all }}
  annotations:
    {{- toYaml $all | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "imdedup.image" -}}
{{- $repo := .Values.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repo = printf "%s/%s" .Values.image.registry $repo -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{- define "imdedup.imagePullSecrets" -}}
{{- if .Values.image.pullSecrets }}
imagePullSecrets:
{{- range .Values.image.pullSecrets }}
  {{- if kindIs "map" . }}
  - name: {{ .name }}
  {{- else }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "imdedup.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "imdedup.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- modes */}}

{{/* "true" in the ScyllaDB mode (scylla.nodes set), else empty. */}}
{{- define "imdedup.scyllaMode" -}}
{{- if .Values.scylla.nodes }}true{{ end -}}
{{- end -}}

{{/* "true" when the ingest shards use Redis for the window, else empty. */}}
{{- define "imdedup.redisEnabled" -}}
{{- if or .Values.redis.url (and .Values.redis.existingSecret .Values.redis.existingSecretUrlKey) }}true{{ end -}}
{{- end -}}

{{/* "true" when the migration Job runs (ScyllaDB mode and migration.enabled). */}}
{{- define "imdedup.migrationJob" -}}
{{- if and (include "imdedup.scyllaMode" .) .Values.migration.enabled }}true{{ end -}}
{{- end -}}

{{/* ------------------------------------------------------------ addresses */}}

{{- define "imdedup.ingest.headless" -}}
{{- printf "%s-headless" (include "imdedup.componentName" (list . "ingest")) -}}
{{- end -}}

{{/*
The ingest shard list, derived from ingest.replicas: NAME=URL entries,
comma-separated, where NAME is the StatefulSet pod name (the shard's
IMDEDUP_SHARD_NAME) and URL its stable DNS name behind the headless Service.
Gateways and ingest shards get the same list.
*/}}
{{- define "imdedup.ingest.shards" -}}
{{- $sts := include "imdedup.componentName" (list . "ingest") -}}
{{- $headless := include "imdedup.ingest.headless" . -}}
{{- $ns := include "imdedup.namespace" . -}}
{{- $entries := list -}}
{{- range $i := until (int .Values.ingest.replicas) -}}
{{- $pod := printf "%s-%d" $sts $i -}}
{{- $entries = append $entries (printf "%s=http://%s.%s.%s.svc.%s:%d" $pod $pod $headless $ns $.Values.clusterDomain (int $.Values.ingest.containerPorts.grpc)) -}}
{{- end -}}
{{- join "," $entries -}}
{{- end -}}

{{- define "imdedup.storage.url" -}}
{{- printf "http://%s.%s.svc.%s:%d" (include "imdedup.componentName" (list . "storage")) (include "imdedup.namespace" .) .Values.clusterDomain (int .Values.storage.containerPorts.grpc) -}}
{{- end -}}

{{/* ------------------------------------------------------------- secrets */}}

{{/* The chart-managed Secret's name. */}}
{{- define "imdedup.secretName" -}}
{{- include "imdedup.fullname" . -}}
{{- end -}}

{{/*
The token secret: auth.tokenSecret, else the one already in the release's
Secret (lookup, so upgrades keep it), else a new random one. Generated once
per render (kept in .Values) so the Secret and its checksum agree.
*/}}
{{- define "imdedup.tokenSecret" -}}
{{- if .Values.auth.tokenSecret -}}
{{- .Values.auth.tokenSecret -}}
{{- else -}}
{{- if not (hasKey .Values "__imdedupGeneratedToken") -}}
{{- $token := randAlphaNum 48 -}}
{{- $existing := lookup "v1" "Secret" (include "imdedup.namespace" .) (include "imdedup.secretName" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "token-secret") -}}
{{- $token = index $existing.data "token-secret" | b64dec -}}
{{- end -}}
{{- $_ := set .Values "__imdedupGeneratedToken" $token -}}
{{- end -}}
{{- index .Values "__imdedupGeneratedToken" -}}
{{- end -}}
{{- end -}}

{{/* The chart's Secret's data, also hashed into the pods' checksum/secret annotation. */}}
{{- define "imdedup.secretData" -}}
{{- if not .Values.auth.existingSecret }}
token-secret: {{ include "imdedup.tokenSecret" . | b64enc | quote }}
{{- end }}
{{- if and .Values.redis.password (not .Values.redis.existingSecret) }}
redis-password: {{ .Values.redis.password | b64enc | quote }}
{{- end }}
{{- if and .Values.scylla.password (not .Values.scylla.existingSecret) }}
scylla-password: {{ .Values.scylla.password | b64enc | quote }}
{{- end }}
{{- end -}}

{{/* Whether the chart's Secret has anything to hold. */}}
{{- define "imdedup.secretNeeded" -}}
{{- if or (not .Values.auth.existingSecret) (and .Values.redis.password (not .Values.redis.existingSecret)) (and .Values.scylla.password (not .Values.scylla.existingSecret)) }}true{{ end -}}
{{- end -}}

{{/* Where IMDEDUP_TOKEN_SECRET comes from: a secretKeyRef body. */}}
{{- define "imdedup.tokenSecretRef" -}}
name: {{ .Values.auth.existingSecret | default (include "imdedup.secretName" .) }}
key: {{ ternary .Values.auth.existingSecretTokenKey "token-secret" (not (empty .Values.auth.existingSecret)) }}
{{- end -}}

{{/* "true" when a Redis password is configured (values or existing Secret). */}}
{{- define "imdedup.redisPassword" -}}
{{- if and (include "imdedup.redisEnabled" .) (not .Values.redis.existingSecretUrlKey) (or .Values.redis.password .Values.redis.existingSecret) }}true{{ end -}}
{{- end -}}

{{/*
The Redis env vars of an ingest container: the password (when there is one)
as REDIS_PASSWORD from a Secret, then IMDEDUP_REDIS_URL with the password put
into every URL by Kubernetes' $(VAR) expansion; or the whole URL list from
redis.existingSecret[existingSecretUrlKey].
*/}}
{{- define "imdedup.redisEnv" -}}
{{- if and .Values.redis.existingSecret .Values.redis.existingSecretUrlKey }}
- name: IMDEDUP_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretUrlKey }}
{{- else if .Values.redis.url }}
{{- if contains "@" .Values.redis.url }}
{{- fail "redis.url must not contain credentials: set redis.password (or redis.existingSecret), or put the whole URL list in a Secret and set redis.existingSecret with redis.existingSecretUrlKey" }}
{{- end }}
{{- $password := include "imdedup.redisPassword" . }}
{{- if $password }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret | default (include "imdedup.secretName" .) }}
      key: {{ ternary .Values.redis.existingSecretPasswordKey "redis-password" (not (empty .Values.redis.existingSecret)) }}
{{- end }}
{{- $urls := list }}
{{- range splitList "," .Values.redis.url }}
{{- $url := trim . }}
{{- if $url }}
{{- if $password }}
{{- $parts := splitn "://" 2 $url }}
{{- if not $parts._1 }}
{{- fail (printf "redis.url: %q is not a redis:// or rediss:// URL" $url) }}
{{- end }}
{{- $url = printf "%s://%s:$(REDIS_PASSWORD)@%s" $parts._0 $.Values.redis.username $parts._1 }}
{{- end }}
{{- $urls = append $urls $url }}
{{- end }}
{{- end }}
- name: IMDEDUP_REDIS_URL
  value: {{ join "," $urls | quote }}
{{- end }}
{{- end -}}

{{/* "true" when a ScyllaDB password is configured. */}}
{{- define "imdedup.scyllaPassword" -}}
{{- if or .Values.scylla.password .Values.scylla.existingSecret }}true{{ end -}}
{{- end -}}

{{/*
The ScyllaDB env vars of ingest, storage and the migration Job.
Usage: include "imdedup.scyllaEnv" (dict "root" . "secretName" NAME "migrate" BOOL)
secretName: the Secret holding `scylla-password` when the password comes
from values (the migration Job has its own hook Secret).
*/}}
{{- define "imdedup.scyllaEnv" -}}
{{- $root := .root -}}
{{- $v := $root.Values.scylla -}}
- name: IMDEDUP_SCYLLA_NODES
  value: {{ join "," $v.nodes | quote }}
- name: IMDEDUP_SCYLLA_KEYSPACE
  value: {{ $v.keyspace | quote }}
- name: IMDEDUP_SCYLLA_REPLICATION_FACTOR
  value: {{ $v.replicationFactor | quote }}
- name: IMDEDUP_SCYLLA_CONSISTENCY
  value: {{ $v.consistency | quote }}
- name: IMDEDUP_SCYLLA_SERIAL_CONSISTENCY
  value: {{ $v.serialConsistency | quote }}
- name: IMDEDUP_SCYLLA_TIMEOUT
  value: {{ $v.timeout | quote }}
{{- if $v.localDc }}
- name: IMDEDUP_SCYLLA_LOCAL_DC
  value: {{ $v.localDc | quote }}
{{- end }}
{{- if hasKey . "migrate" }}
- name: IMDEDUP_SCYLLA_MIGRATE
  value: {{ .migrate | quote }}
{{- end }}
{{- if $v.user }}
- name: IMDEDUP_SCYLLA_USER
  value: {{ $v.user | quote }}
{{- end }}
{{- if include "imdedup.scyllaPassword" $root }}
- name: IMDEDUP_SCYLLA_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.existingSecret | default .secretName }}
      key: {{ ternary $v.existingSecretPasswordKey "scylla-password" (not (empty $v.existingSecret)) }}
{{- end }}
{{- if $v.caSecret.name }}
- name: IMDEDUP_SCYLLA_CA
  value: /etc/imdedup/scylla-ca/{{ $v.caSecret.key }}
{{- end }}
{{- end -}}

{{/* The env vars every service and the migration Job share. */}}
{{- define "imdedup.commonEnv" -}}
{{- if .Values.config.logLevel }}
RUST_LOG: {{ .Values.config.logLevel | quote }}
{{- end }}
{{- with .Values.otel.endpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT: {{ . | quote }}
{{- end }}
{{- with .Values.otel.tracesSampler }}
OTEL_TRACES_SAMPLER: {{ . | quote }}
{{- end }}
{{- with .Values.otel.tracesSamplerArg }}
OTEL_TRACES_SAMPLER_ARG: {{ . | quote }}
{{- end }}
{{- with .Values.otel.resourceAttributes }}
OTEL_RESOURCE_ATTRIBUTES: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------- pods */}}

{{- define "imdedup.terminationGracePeriodSeconds" -}}
{{- $c := index . 1 -}}
{{- $root := index . 0 -}}
{{- if $c.terminationGracePeriodSeconds -}}
{{- $c.terminationGracePeriodSeconds -}}
{{- else -}}
{{- add (int $root.Values.config.preStopSleepSeconds) (int $root.Values.config.graceSeconds) 5 -}}
{{- end -}}
{{- end -}}

{{/*
topologySpreadConstraints: the component's own, else the preset (spread over
zones and nodes; soft = ScheduleAnyway, hard = DoNotSchedule).
Usage: include "imdedup.topologySpread" (list . "gateway" .Values.gateway)
*/}}
{{- define "imdedup.topologySpread" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $c := index . 2 -}}
{{- if $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml $c.topologySpreadConstraints | nindent 2 }}
{{- else if ne $c.topologySpreadPreset "none" }}
{{- $when := ternary "DoNotSchedule" "ScheduleAnyway" (eq $c.topologySpreadPreset "hard") }}
topologySpreadConstraints:
{{- range list "topology.kubernetes.io/zone" "kubernetes.io/hostname" }}
  - maxSkew: 1
    topologyKey: {{ . }}
    whenUnsatisfiable: {{ $when }}
    labelSelector:
      matchLabels:
        {{- include "imdedup.selectorLabels" (list $root $component) | nindent 8 }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The scheduling fields of a pod spec.
Usage: include "imdedup.scheduling" (list . "gateway" .Values.gateway)
*/}}
{{- define "imdedup.scheduling" -}}
{{- $c := index . 2 -}}
{{- trim (include "imdedup.schedulingFields" .) -}}
{{- end -}}

{{- define "imdedup.schedulingFields" -}}
{{- $c := index . 2 -}}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "imdedup.topologySpread" . }}
{{- end -}}

{{/*
A probe from its values. Usage:
include "imdedup.probe" (dict "values" .Values.gateway.livenessProbe "handler" (dict "httpGet" (dict "path" "/healthz" "port" "http")))
*/}}
{{- define "imdedup.probe" -}}
{{- toYaml .handler }}
{{- range $key := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "failureThreshold" "successThreshold" }}
{{- if hasKey $.values $key }}
{{ $key }}: {{ index $.values $key }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The pod-level fields every workload shares. */}}
{{- define "imdedup.podCommon" -}}
serviceAccountName: {{ include "imdedup.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
enableServiceLinks: false
{{- include "imdedup.imagePullSecrets" . }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/*
Checksum annotations of a pod template: the sha256 of the component's
rendered ConfigMap and of the chart's rendered Secret, so a configuration
change rolls the pods.
*/}}
{{- define "imdedup.checksums" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
checksum/config: {{ include (printf "imdedup.%s.configData" $component) $root | sha256sum }}
{{- if include "imdedup.secretNeeded" $root }}
checksum/secret: {{ include "imdedup.secretData" $root | sha256sum }}
{{- end }}
{{- end -}}

{{/* The native preStop pause (the image has no shell and no sleep binary). */}}
{{- define "imdedup.lifecycle" -}}
{{- if gt (int .Values.config.preStopSleepSeconds) 0 -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.config.preStopSleepSeconds }}
{{- end -}}
{{- end -}}
