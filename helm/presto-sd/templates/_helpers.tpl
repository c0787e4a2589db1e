{{/* Names, labels and the image: the conventions of `helm create`. */}}

{{- define "presto-sd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-presto-sd, cut so that "-orchestrator" and a pod ordinal still fit in 63. */}}
{{- define "presto-sd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "presto-sd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "presto-sd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "presto-sd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "presto-sd.labels" -}}
helm.sh/chart: {{ include "presto-sd.chart" . }}
{{ include "presto-sd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of one component (drafter, verifier, orchestrator, ...): dict "root" . "component" name */}}
{{- define "presto-sd.componentSelectorLabels" -}}
{{ include "presto-sd.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "presto-sd.componentLabels" -}}
{{ include "presto-sd.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "presto-sd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "presto-sd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "presto-sd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "presto-sd.engineConfigMapName" -}}
{{ include "presto-sd.fullname" . }}-engine
{{- end }}

{{- define "presto-sd.authSecretName" -}}
{{- default (printf "%s-auth" (include "presto-sd.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Pod annotations that roll the pods when the settings they read change. */}}
{{- define "presto-sd.configChecksums" -}}
checksum/engine: {{ include (print .Template.BasePath "/configmap-engine.yaml") . | sha256sum }}
{{- end }}

{{/*
Comma-separated HOST:PORT of every replica of a StatefulSet behind its headless Service:
dict "root" . "component" "drafter" "replicas" N "port" P
*/}}
{{- define "presto-sd.replicaAddresses" -}}
{{- $svc := printf "%s-%s" (include "presto-sd.fullname" .root) .component }}
{{- $domain := printf "%s.%s.svc.%s" $svc .root.Release.Namespace .root.Values.clusterDomain }}
{{- $addrs := list }}
{{- range $i := until (int .replicas) }}
{{- $addrs = append $addrs (printf "%s-%d.%s:%d" $svc $i $domain (int $.port)) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* DNS name of the Generate API Service, as clients in the cluster use it. */}}
{{- define "presto-sd.orchestratorHost" -}}
{{ include "presto-sd.fullname" . }}-orchestrator.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}
{{- end }}
