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

{{/* The image of the DaemonSet's container and of the helm test pod, the same for both: repository@digest when a digest is set, else repository:tag (the tag defaults to appVersion). */}}
{{- define "multireg.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The repository the release workflow publishes to: the Makefile's IMAGE_REPO, values.yaml's image.repository (e2e/manifests checks both). */}}
{{- define "multireg.publishedRepository" -}}
ghcr.io/multireg/multireg
{{- end }}

{{/* "true" when the image is one nobody publishes: the published repository with a development tag (…-dev, as a development chart's appVersion), no digest. Only a tagged release's image is pushed there. */}}
{{- define "multireg.unpublishedImage" -}}
{{- $tag := toString (.Values.image.tag | default .Chart.AppVersion) }}
{{- if and (eq .Values.image.repository (include "multireg.publishedRepository" .)) (not .Values.image.digest) (contains "-dev" $tag) -}}
true
{{- end }}
{{- end }}

{{/* The pods' service account: the created one (the full name unless named), or the named or "default" one. */}}
{{- define "multireg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "multireg.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* kubelet's root directory, cleaned: a trailing "/" (or "//" inside) names the same directory. */}}
{{- define "multireg.kubeletDir" -}}
{{ clean .Values.kubeletDir }}
{{- end }}

{{/* kubelet's plugins-registry directory on the host, mounted at the same path. */}}
{{- define "multireg.registrationDir" -}}
{{ include "multireg.kubeletDir" . }}/plugins_registry
{{- end }}

{{/* Where the drivers' sockets live on the host, mounted read-only at the same path. */}}
{{- define "multireg.pluginsDir" -}}
{{ include "multireg.kubeletDir" . }}/plugins
{{- end }}

{{/* Where the ConfigMap is mounted, and the drivers file in it. */}}
{{- define "multireg.configDir" -}}
/etc/multireg
{{- end }}

{{/* An entry of extraHostPaths as written: the entry itself, or its path. */}}
{{- define "multireg.extraHostPath" -}}
{{- if kindIs "map" . }}{{ get . "path" }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/*
An entry's hostPath type: its type, else Directory, so that a mistyped path keeps the pod from
starting instead of being created on every node.
*/}}
{{- define "multireg.extraHostPathType" -}}
{{- if kindIs "map" . }}{{ get . "type" | default "Directory" }}{{ else }}Directory{{ end }}
{{- end }}

{{/*
Fails the render when an endpoint or localEndpoint lies outside every directory mounted into the
pod: multireg could not reach the driver's socket (with another kubeletDir, the endpoints must
move too).
*/}}
{{- define "multireg.checkEndpoints" -}}
{{- $dirs := list (include "multireg.pluginsDir" .) }}
{{- range .Values.extraHostPaths }}
{{- $dirs = append $dirs (clean (include "multireg.extraHostPath" .)) }}
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
{{- fail (printf "drivers[%d].%s: %q is not under %s, the directories mounted into the pod: with kubeletDir %q, drivers' sockets are under %s (or add their directory to extraHostPaths)" $i $field $path (join ", " $dirs) (include "multireg.kubeletDir" $) (include "multireg.pluginsDir" $)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Fails the render when an entry of extraHostPaths is a directory the chart mounts already (the
registration directory, the plugins directory, the ConfigMap's) or another entry again, trailing
"/" aside. Kubernetes refuses two mounts at one path: a fresh install would fail ("must be
unique"), and an upgrade would merge the two mounts into one without a word.
*/}}
{{- define "multireg.checkExtraHostPaths" -}}
{{- $mounted := dict (include "multireg.registrationDir" .) "kubelet's plugins-registry directory" (include "multireg.pluginsDir" .) "kubelet's plugins directory" (include "multireg.configDir" .) "the drivers file's directory" }}
{{- if .Values.podResources.enabled }}
{{- $_ := set $mounted (printf "%s/pod-resources" (include "multireg.kubeletDir" .)) "kubelet's pod-resources directory" }}
{{- end }}
{{- $seen := dict }}
{{- range $i, $e := .Values.extraHostPaths }}
{{- $p := include "multireg.extraHostPath" $e }}
{{- $c := clean $p }}
{{- if hasKey $mounted $c }}
{{- fail (printf "extraHostPaths[%d]: %q is mounted by the chart already: %s is %s; remove it from extraHostPaths" $i $p $c (get $mounted $c)) }}
{{- end }}
{{- if hasKey $seen $c }}
{{- fail (printf "extraHostPaths[%d]: %q is extraHostPaths[%s] again: list %s once" $i $p (get $seen $c) $c) }}
{{- end }}
{{- $_ := set $seen $c (toString $i) }}
{{- end }}
{{- end }}

{{/*
A mapping of the drivers file with its keys in the drivers file's order (docs/drivers-file.md's and
values.schema.json's: name, type, endpoint, …), not toYaml's alphabetical one; a backoff's
keys likewise. Keys outside the order (values.schema.json refuses them) follow, sorted, so that
multireg sees and refuses them too. Argument: (list the-map its-key-order).
*/}}
{{- define "multireg.ordered" -}}
{{- $m := index . 0 }}
{{- $order := index . 1 }}
{{- $keys := $order }}
{{- range keys $m | sortAlpha }}
{{- if not (has . $order) }}
{{- $keys = append $keys . }}
{{- end }}
{{- end }}
{{- range $k := $keys }}
{{- if hasKey $m $k }}
{{- $v := index $m $k }}
{{- if and (eq $k "backoff") (kindIs "map" $v) $v }}
{{ $k }}:
  {{- include "multireg.ordered" (list $v (list "initialInterval" "maxInterval" "multiplier" "randomizationFactor")) | trim | nindent 2 }}
{{- else if and (or (kindIs "map" $v) (kindIs "slice" $v)) $v }}
{{ $k }}:
  {{- toYaml $v | nindent 2 }}
{{- else }}
{{ $k }}: {{ toYaml $v }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The drivers file: multireg's RegistrarConfig. */}}
{{- define "multireg.config" -}}
{{- $settings := list "backoff" "registrationTimeout" "waitForEndpoint" "required" "healthTimeout" }}
{{- $driver := concat (list "name" "type" "endpoint" "localEndpoint" "supportedVersions" "socketName") $settings -}}
apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: {{ include "multireg.registrationDir" . }}
{{- with .Values.defaults }}
defaults:
  {{- include "multireg.ordered" (list . $settings) | trim | nindent 2 }}
{{- end }}
{{- if .Values.drivers }}
drivers:
{{- range .Values.drivers }}
  {{- if kindIs "map" . }}
  - {{ include "multireg.ordered" (list . $driver) | trim | indent 4 | trim }}
  {{- else }}
  - {{ toYaml . }}
  {{- end }}
{{- end }}
{{- else }}
drivers: []
{{- end }}
{{- end }}

{{/* The pods' service account as the API server names the user of its token. */}}
{{- define "multireg.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "multireg.serviceAccountName" . }}
{{- end }}

{{/* The name of the node condition's cluster-wide objects: its ClusterRole and binding, its ValidatingAdmissionPolicy and binding. */}}
{{- define "multireg.nodeConditionName" -}}
{{ include "multireg.fullname" . }}-node-condition
{{- end }}

{{/*
Fails the render when a value of the node condition is set while the condition is off: a
startup taint nobody removes would keep every pod that does not tolerate it off the nodes.
*/}}
{{- define "multireg.checkNodeCondition" -}}
{{- if and (not .Values.nodeCondition.enabled) .Values.nodeCondition.startupTaint }}
{{- fail (printf "nodeCondition.startupTaint %q: multireg removes it only with the node condition; set nodeCondition.enabled: true, or startupTaint: \"\"" .Values.nodeCondition.startupTaint) }}
{{- end }}
{{- end }}

{{/* The startup taint, KEY[=VALUE]:EFFECT, as a dict of key, value and effect. */}}
{{- define "multireg.startupTaint" -}}
{{- $kv := regexReplaceAll ":[^:]*$" .Values.nodeCondition.startupTaint "" }}
{{- $effect := regexReplaceAll "^.*:" .Values.nodeCondition.startupTaint "" }}
{{- $key := regexReplaceAll "=.*$" $kv "" }}
{{- $value := "" }}
{{- if contains "=" $kv }}{{ $value = regexReplaceAll "^[^=]*=" $kv "" }}{{ end }}
{{- dict "key" $key "value" $value "effect" $effect | toJson }}
{{- end }}

{{/*
Fails the render when the health checks' ports clash with each other or with httpPort: on the
host's network each is a port of the node, and multireg listens on each.
*/}}
{{- define "multireg.checkHealthChecks" -}}
{{- with .Values.healthChecks }}
{{- if .enabled }}
{{- if eq (int .port) (int $.Values.httpPort) }}
{{- fail (printf "healthChecks.port %d is httpPort: give the health checks a port of their own" (int .port)) }}
{{- end }}
{{- if and .grpcPort (or (eq (int .grpcPort) (int .port)) (eq (int .grpcPort) (int $.Values.httpPort))) }}
{{- fail (printf "healthChecks.grpcPort %d is healthChecks.port or httpPort: give it a port of its own, or 0 for none" (int .grpcPort)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A probe of the DaemonSet's container, from its value (argument: (list root probe)). With the
health checks the container declares no ports (the pods are on the host's network), so a port
named http (httpGet or tcpSocket) becomes httpPort's number; another name resolves to nothing
there, and fails the render.
*/}}
{{- define "multireg.probe" -}}
{{- $root := index . 0 }}
{{- $probe := deepCopy (index . 1) }}
{{- if $root.Values.healthChecks.enabled }}
{{- range $handler := list "httpGet" "tcpSocket" }}
{{- $h := get $probe $handler }}
{{- if and (kindIs "map" $h) (kindIs "string" $h.port) }}
{{- if eq $h.port "http" }}
{{- $_ := set $h "port" (int $root.Values.httpPort) }}
{{- else }}
{{- fail (printf "a probe's %s.port %q: with healthChecks.enabled the container declares no ports, so a probe gives its port by number (or http, httpPort's)" $handler $h.port) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $probe }}
{{- end }}
