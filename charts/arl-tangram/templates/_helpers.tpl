{{/*
Names and labels shared by the templates. The generated CRD templates (templates/crds/,
written by `tangram crds`) include "arl-tangram.labels": keep that name.
*/}}

{{/* The chart's name, for app.kubernetes.io/name. */}}
{{- define "arl-tangram.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The name of the release's objects: the release name, with the chart's name appended
unless the release name already contains it.
*/}}
{{- define "arl-tangram.fullname" -}}
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

{{/* Cluster-scoped objects: the release's namespace and full name (pools' own
ClusterRoles are tangram-<ns>.<pool>-tokenreview: no clash). */}}
{{- define "arl-tangram.clusterName" -}}
{{- printf "%s.%s" .Release.Namespace (include "arl-tangram.fullname" .) | trunc 253 | trimSuffix "-" | trimSuffix "." }}
{{- end }}

{{/* The port of kopf's liveness endpoint: the node's livenessPort in loopback mode. */}}
{{- define "arl-tangram.livenessPort" -}}
{{- if .Values.loopback.enabled }}{{ .Values.loopback.livenessPort }}{{ else }}8080{{ end }}
{{- end }}

{{/* A duration as Prometheus writes it (1h30m, 10s, 500ms) in milliseconds. */}}
{{- define "arl-tangram.durationMs" -}}
{{- $ms := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 }}
{{- $total := 0 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 }}
{{- $n := regexFind "^[0-9]+" . }}
{{- $total = add $total (mul (atoi $n) (get $ms (trimPrefix $n .))) }}
{{- end }}
{{- $total }}
{{- end }}

{{- define "arl-tangram.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the release (no app.kubernetes.io/part-of: the CRDs have it). */}}
{{- define "arl-tangram.labels" -}}
helm.sh/chart: {{ include "arl-tangram.chart" . }}
{{ include "arl-tangram.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
What the operator's Deployment selects its pod by (immutable once installed). The
component keeps the operator apart from the pools' schedulers and agents, which carry
app.kubernetes.io/name=arl-tangram too.
*/}}
{{- define "arl-tangram.selectorLabels" -}}
app.kubernetes.io/name: {{ include "arl-tangram.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "arl-tangram.operatorSelectorLabels" -}}
{{ include "arl-tangram.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Refuses extra labels from values (podLabels, serviceMonitor.labels) that name a label the
chart sets on the same object: the key would be rendered twice, and a changed selector
label would leave the operator's Deployment selecting no pod. Renders nothing. Call with
(dict "root" $ "labels" MAP "from" "VALUE NAME").
*/}}
{{- define "arl-tangram.checkExtraLabels" -}}
{{- $own := merge (fromYaml (include "arl-tangram.labels" .root)) (fromYaml (include "arl-tangram.operatorSelectorLabels" .root)) }}
{{- range $key := keys .labels | sortAlpha }}
{{- if hasKey $own $key }}
{{- fail (printf "%s: %q is a label the chart sets itself (to %q; the operator's Deployment selects its pod by app.kubernetes.io/name, app.kubernetes.io/instance and app.kubernetes.io/component): leave it out" $.from $key (get $own $key)) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "arl-tangram.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "arl-tangram.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator's image: repository@digest, else repository:tag (tag: the appVersion). */}}
{{- define "arl-tangram.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The image of the pools' schedulers and node agents: poolImage, else the operator's. */}}
{{- define "arl-tangram.poolImage" -}}
{{- .Values.poolImage | default (include "arl-tangram.image" .) }}
{{- end }}
