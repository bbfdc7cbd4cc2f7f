{{/* Helpers of the monitoring objects (values under metrics): docs/monitoring.md. */}}

{{/*
The labels of a monitoring object: the chart's standard labels, as the component monitoring,
and the extra ones of its values (.extra), which win.
*/}}
{{- define "multireg.monitoringLabels" -}}
{{- $std := include "multireg.labels" .root | fromYaml }}
{{- toYaml (merge (dict) (.extra | default dict) (dict "app.kubernetes.io/component" "monitoring") $std) }}
{{- end }}

{{/* The namespace of a monitoring object: its value's, or the release's. */}}
{{- define "multireg.monitoringNamespace" -}}
{{- .namespace | default .root.Release.Namespace }}
{{- end }}

{{/*
The relabeling that makes every series attributable to its node: the pod's node name as the
label node, which the alerts and the dashboard use. Then the target's address when the pods
declare no port (.address), then the user's relabelings.
*/}}
{{- define "multireg.relabelings" -}}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- with .address }}
{{ . }}
{{- end }}
{{- with .relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The relabelings that give a PodMonitor's target its address when the pods declare no port (the
health checks put them on the host's network: healthChecks in values.yaml). Prometheus then
finds one target per container, whose address is the pod IP alone: keep the multireg
container's, and add httpPort to its address (an IPv6 address in brackets). Argument: the root.
*/}}
{{- define "multireg.addressRelabelings" -}}
- action: keep
  sourceLabels: [__meta_kubernetes_pod_container_name]
  regex: multireg
- action: replace
  sourceLabels: [__address__]
  regex: (.*:.*)
  targetLabel: __address__
  replacement: "[${1}]:{{ .Values.httpPort }}"
- action: replace
  sourceLabels: [__address__]
  regex: ([^:]+)
  targetLabel: __address__
  replacement: "${1}:{{ .Values.httpPort }}"
{{- end }}

{{/*
The scrape settings a PodMonitor's and a ServiceMonitor's endpoint share. Argument: (dict "root"
the-root "monitor" its-values "pods" true-for-a-PodMonitor). A ServiceMonitor scrapes the
Service's port http, which targets httpPort by number when the pods declare no port; a
PodMonitor the pods' port http, or, when they declare none, httpPort by relabeling.
*/}}
{{- define "multireg.scrapeEndpoint" -}}
{{- $noPorts := and .pods .root.Values.healthChecks.enabled }}
{{- with .monitor }}
{{- if not $noPorts }}
port: http
{{- end }}
path: /metrics
{{- with .interval }}
interval: {{ . }}
{{- end }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
relabelings:
  {{- include "multireg.relabelings" (dict "relabelings" .relabelings "address" (ternary (include "multireg.addressRelabelings" $.root) "" $noPorts)) | nindent 2 }}
{{- with .metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fails the render when both a PodMonitor and a ServiceMonitor would scrape every pod. */}}
{{- define "multireg.checkOneMonitor" -}}
{{- if and .Values.metrics.podMonitor.enabled .Values.metrics.serviceMonitor.enabled }}
{{- fail "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled: enable one of them; both would scrape every pod twice, and every alert would fire twice" }}
{{- end }}
{{- end }}
