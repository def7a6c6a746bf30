{{/* Names, labels and the operator's arguments, shared by every template. */}}

{{/* The chart name, or nameOverride. */}}
{{- define "slipstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base of object names: fullnameOverride, else "<release>-<chart>" (just "<release>" when the
release name already contains the chart name). 52 characters leave room for suffixes.
*/}}
{{- define "slipstream.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "slipstream.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The pod selector: small and stable (a Deployment's selector is immutable). */}}
{{- define "slipstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object the chart creates. */}}
{{- define "slipstream.commonLabels" -}}
helm.sh/chart: {{ include "slipstream.chart" . }}
app.kubernetes.io/name: {{ include "slipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: slipstream
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of the operator's objects (its Deployment, ServiceAccount, RBAC). */}}
{{- define "slipstream.labels" -}}
{{ include "slipstream.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "slipstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "slipstream.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image, tag defaulting to the chart's appVersion. */}}
{{- define "slipstream.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* `slipstream operator run` arguments, one per line of a YAML list. */}}
{{- define "slipstream.operatorArgs" -}}
- operator
- run
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace
- {{ . | quote }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --liveness
- {{ printf "http://0.0.0.0:%d/healthz" (int .Values.operator.healthPort) | quote }}
{{- if .Values.peering.enabled }}
- --peering
- {{ .Values.peering.name | quote }}
{{- else }}
- --standalone
{{- end }}
- --resync-seconds
- {{ .Values.operator.resyncSeconds | quote }}
- --cluster-domain
- {{ .Values.operator.clusterDomain | quote }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- end }}
