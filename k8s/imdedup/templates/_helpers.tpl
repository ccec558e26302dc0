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
{{- $entries = append $entries (printf "%s=%s://%s.%s.%s.svc.%s:%d" $pod (include "imdedup.tls.scheme" $) $pod $headless $ns $.Values.clusterDomain (int $.Values.ingest.containerPorts.grpc)) -}}
{{- end -}}
{{- join "," $entries -}}
{{- end -}}

{{/* The storage Service's DNS name, the host the gateways and ingest shards dial. */}}
{{- define "imdedup.storage.host" -}}
{{- printf "%s.%s.svc.%s" (include "imdedup.componentName" (list . "storage")) (include "imdedup.namespace" .) .Values.clusterDomain -}}
{{- end -}}

{{- define "imdedup.storage.url" -}}
{{- printf "%s://%s:%d" (include "imdedup.tls.scheme" .) (include "imdedup.storage.host" .) (int .Values.storage.containerPorts.grpc) -}}
{{- end -}}

{{/*
The TCP port of gateway.authz.membershipUrl: the URL's, else 80 for http://
and 443 otherwise (as the gateway dials it).
*/}}
{{- define "imdedup.membership.port" -}}
{{- $u := urlParse .Values.gateway.authz.membershipUrl -}}
{{- if not $u.host -}}
{{- fail (printf "gateway.authz.membershipUrl: %q is not a URL like https://membership.ns.svc:7400" .Values.gateway.authz.membershipUrl) -}}
{{- end -}}
{{- regexFind ":[0-9]+$" $u.host | trimPrefix ":" | default (ternary "80" "443" (eq $u.scheme "http")) -}}
{{- end -}}

{{/* -------------------------------------------------------- internal TLS */}}

{{/*
How the internal gRPC hops are secured: "certManager" (Certificates issued
by cert-manager), "existingSecrets" (the user's own PKI) or "" (plaintext,
internalTls.enabled=false). Fails on an incomplete choice.
*/}}
{{- define "imdedup.tls.mode" -}}
{{- $t := .Values.internalTls -}}
{{- if $t.enabled -}}
{{- $given := list -}}
{{- range $component := list "gateway" "ingest" "storage" -}}
{{- if index $t.existingSecrets $component }}{{ $given = append $given $component }}{{ end -}}
{{- end -}}
{{- if $given -}}
{{- if lt (len $given) 3 -}}
{{- fail (printf "internalTls.existingSecrets: give the Secrets of gateway, ingest and storage together (only %s given), or none to use cert-manager" (join ", " $given)) -}}
{{- end -}}
existingSecrets
{{- else if $t.certManager.enabled -}}
certManager
{{- else -}}
{{- fail "internalTls: with internalTls.certManager.enabled=false, give internalTls.existingSecrets.{gateway,ingest,storage} (or internalTls.enabled=false for a plaintext trial)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "https" with internal TLS, else "http". */}}
{{- define "imdedup.tls.scheme" -}}
{{- ternary "https" "http" (not (empty (include "imdedup.tls.mode" .))) -}}
{{- end -}}

{{/* "true" when the chart bootstraps its own CA (cert-manager, no issuerRef.name). */}}
{{- define "imdedup.tls.bootstrapCA" -}}
{{- if and (eq (include "imdedup.tls.mode" .) "certManager") (not .Values.internalTls.certManager.issuerRef.name) }}true{{ end -}}
{{- end -}}

{{/*
A component's TLS identity: the DNS name its certificate carries and the
servers it calls allow (IMDEDUP_TLS_ALLOW_CLIENTS), its component name.
Usage: include "imdedup.tls.identity" (list . "gateway")
*/}}
{{- define "imdedup.tls.identity" -}}
{{- include "imdedup.componentName" . -}}
{{- end -}}

{{/* The Secret holding a component's tls.crt, tls.key and ca.crt. Usage: (list . "ingest") */}}
{{- define "imdedup.tls.secretName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- if eq (include "imdedup.tls.mode" $root) "existingSecrets" -}}
{{- index $root.Values.internalTls.existingSecrets $component -}}
{{- else -}}
{{- printf "%s-tls" (include "imdedup.componentName" (list $root $component)) -}}
{{- end -}}
{{- end -}}

{{/*
A component's certificate DNS names, as a JSON list: its identity first,
then the names it is dialled at (the hosts of IMDEDUP_SHARDS and
IMDEDUP_STORAGE_URL). The gateway is dialled by no one.
Usage: include "imdedup.tls.dnsNames" (list . "ingest") | fromJsonArray
*/}}
{{- define "imdedup.tls.dnsNames" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $ns := include "imdedup.namespace" $root -}}
{{- $names := list (include "imdedup.tls.identity" .) -}}
{{- if eq $component "ingest" -}}
{{- /* every shard at <pod>.<headless>.<ns>.svc.<clusterDomain>: one wildcard, so scaling needs no new certificate */ -}}
{{- $names = append $names (printf "*.%s.%s.svc.%s" (include "imdedup.ingest.headless" $root) $ns $root.Values.clusterDomain) -}}
{{- else if eq $component "storage" -}}
{{- $svc := include "imdedup.componentName" (list $root "storage") -}}
{{- $names = concat $names (list (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (include "imdedup.storage.host" $root)) -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/*
The callers a server accepts (IMDEDUP_TLS_ALLOW_CLIENTS), comma-separated
identities: ingest accepts the gateways; storage the gateways, and the ingest
shards in the embedded mode (in the ScyllaDB mode they never call storage).
*/}}
{{- define "imdedup.tls.allowClients" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $clients := list (include "imdedup.tls.identity" (list $root "gateway")) -}}
{{- if and (eq $component "storage") (not (include "imdedup.scyllaMode" $root)) -}}
{{- $clients = prepend $clients (include "imdedup.tls.identity" (list $root "ingest")) -}}
{{- end -}}
{{- join "," $clients -}}
{{- end -}}

{{/*
The privateKey of the chart's Certificates. Usage:
include "imdedup.tls.privateKey" (list . "Always") -- a new key at every
renewal (the services' certificates); "Never" for the bootstrapped CA, whose
renewal then keeps its key and subject, so certificates signed before and
after chain to the same trust anchor and nothing breaks in between.
*/}}
{{- define "imdedup.tls.privateKey" -}}
{{- $key := (index . 0).Values.internalTls.certManager.privateKey -}}
algorithm: {{ $key.algorithm }}
{{- if ne $key.algorithm "Ed25519" }}
size: {{ $key.size }}
{{- end }}
rotationPolicy: {{ index . 1 }}
{{- end -}}

{{/* Where a component's TLS Secret is mounted (a directory, so renewals reach the files). */}}
{{- define "imdedup.tls.mountPath" -}}/etc/imdedup/tls{{- end -}}

{{/*
The internal TLS part of a component's ConfigMap data (hashed into
checksum/config: paths and names, never the Secret's contents, so a renewed
certificate does not restart the pods).
Usage: include "imdedup.tls.configData" (list . "storage")
*/}}
{{- define "imdedup.tls.configData" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $dir := include "imdedup.tls.mountPath" $root -}}
{{- if include "imdedup.tls.mode" $root }}
IMDEDUP_TLS_CERT: {{ printf "%s/tls.crt" $dir | quote }}
IMDEDUP_TLS_KEY: {{ printf "%s/tls.key" $dir | quote }}
IMDEDUP_TLS_CA: {{ printf "%s/ca.crt" $dir | quote }}
{{- if ne $component "gateway" }}
IMDEDUP_TLS_ALLOW_CLIENTS: {{ include "imdedup.tls.allowClients" . | quote }}
{{- end }}
{{- else }}
# internalTls.enabled=false: plaintext, for trying out only
IMDEDUP_INSECURE_PLAINTEXT: "true"
{{- end }}
{{- if ne $component "gateway" }}
IMDEDUP_GRPC_REFLECTION: {{ $root.Values.config.grpcReflection | toString | quote }}
{{- end }}
{{- end -}}

{{/* The TLS volume mount of a component's container, or nothing. Usage: (list . "ingest") */}}
{{- define "imdedup.tls.volumeMount" -}}
{{- if include "imdedup.tls.mode" (index . 0) }}
# A directory mount, not subPath, so renewed certificates reach the files,
# which the service reads again when they change.
- name: internal-tls
  mountPath: {{ include "imdedup.tls.mountPath" (index . 0) }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The TLS volume of a component's pods, or nothing. Usage: (list . "ingest") */}}
{{- define "imdedup.tls.volume" -}}
{{- if include "imdedup.tls.mode" (index . 0) }}
- name: internal-tls
  secret:
    secretName: {{ include "imdedup.tls.secretName" . }}
{{- end }}
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
