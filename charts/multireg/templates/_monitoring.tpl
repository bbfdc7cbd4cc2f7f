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
label node, which the alerts and the dashboard use. Then the user's relabelings.
*/}}
{{- define "multireg.relabelings" -}}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- with .relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The scrape settings a PodMonitor's and a ServiceMonitor's endpoint share. */}}
{{- define "multireg.scrapeEndpoint" -}}
port: http
path: /metrics
{{- with .interval }}
interval: {{ . }}
{{- end }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
relabelings:
  {{- include "multireg.relabelings" . | nindent 2 }}
{{- with .metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Fails the render when both a PodMonitor and a ServiceMonitor would scrape every pod. */}}
{{- define "multireg.checkOneMonitor" -}}
{{- if and .Values.metrics.podMonitor.enabled .Values.metrics.serviceMonitor.enabled }}
{{- fail "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled: enable one of them; both would scrape every pod twice, and every alert would fire twice" }}
{{- end }}
{{- end }}
