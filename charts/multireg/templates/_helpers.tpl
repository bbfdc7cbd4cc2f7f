{{/* The chart's name, for the app.kubernetes.io/name label. */}}
{{- define "multireg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The name of the DaemonSet and its ConfigMap: the release name, prefixed to the chart's name unless it contains it. */}}
{{- define "multireg.fullname" -}}
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

{{/* helm.sh/chart: name and version. */}}
{{- define "multireg.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods: never change them in an upgrade (a DaemonSet's selector is immutable). */}}
{{- define "multireg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "multireg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The standard labels of every object. */}}
{{- define "multireg.labels" -}}
{{ include "multireg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: registrar
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "multireg.chart" . }}
{{- end }}

{{/* kubelet's plugins-registry directory on the host, mounted at the same path. */}}
{{- define "multireg.registrationDir" -}}
{{ .Values.kubeletDir }}/plugins_registry
{{- end }}

{{/* Where the drivers' sockets live on the host, mounted read-only at the same path. */}}
{{- define "multireg.pluginsDir" -}}
{{ .Values.kubeletDir }}/plugins
{{- end }}

{{/* Where the ConfigMap is mounted, and the drivers file in it. */}}
{{- define "multireg.configDir" -}}
/etc/multireg
{{- end }}

{{/*
Fails the render when an endpoint or localEndpoint lies outside every directory mounted into the
pod: multireg could not reach the driver's socket (with another kubeletDir, the endpoints must
move too).
*/}}
{{- define "multireg.checkEndpoints" -}}
{{- $dirs := list (include "multireg.pluginsDir" .) }}
{{- range .Values.extraHostPaths }}
{{- $dirs = append $dirs . }}
{{- end }}
{{- range $i, $d := .Values.drivers }}
{{- range $field := list "endpoint" "localEndpoint" }}
{{- $path := get $d $field }}
{{- if $path }}
{{- $under := false }}
{{- range $dirs }}
{{- if hasPrefix (printf "%s/" .) $path }}
{{- $under = true }}
{{- end }}
{{- end }}
{{- if not $under }}
{{- fail (printf "drivers[%d].%s: %q is not under %s, the directories mounted into the pod: with kubeletDir %q, drivers' sockets are under %s (or add their directory to extraHostPaths)" $i $field $path (join ", " $dirs) $.Values.kubeletDir (include "multireg.pluginsDir" $)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The drivers file: multireg's RegistrarConfig. */}}
{{- define "multireg.config" -}}
apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: {{ include "multireg.registrationDir" . }}
{{- with .Values.defaults }}
defaults:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.drivers }}
drivers:
  {{- toYaml .Values.drivers | nindent 2 }}
{{- else }}
drivers: []
{{- end }}
{{- end }}
