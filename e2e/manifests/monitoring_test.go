package manifests

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8sjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// The monitoring that multireg ships (docs/monitoring.md): the chart's PodMonitor or
// ServiceMonitor (with its Service), PrometheusRule and dashboard ConfigMap, the kustomize
// component of examples/monitoring, and the rules file and dashboard they all take from
// charts/multireg/files.

var update = flag.Bool("update", false, "rewrite the generated files of examples/monitoring from charts/multireg/files")

// The one source of the alerts and of the dashboard, and their copies in examples/monitoring.
const (
	rulesSource     = "charts/multireg/files/prometheus-rules.yaml"
	dashboardSource = "charts/multireg/files/dashboard.json"
	examplesMon     = "examples/monitoring"
	alertTests      = "e2e/monitoring/alerts_test.yaml"
	runbook         = "docs/runbook.md"
)

// The defaults the rules file spells, which the chart replaces by the release's values.
const (
	defaultJob        = "multireg"
	defaultDaemonSet  = "multireg"
	defaultRunbookURL = "RUNBOOK_URL" // the chart requires its value
	defaultHTTPPort   = "9809"
)

// monitoringSerializer decodes strictly, as the API server does with the Operator's CRDs
// installed: the Kubernetes kinds into k8s.io/api, the Operator's into its Go API types
// (which its CRDs are generated from).
var monitoringSerializer = func() *k8sjson.Serializer {
	scheme := k8sruntime.NewScheme()
	for _, add := range []func(*k8sruntime.Scheme) error{appsv1.AddToScheme, corev1.AddToScheme, rbacv1.AddToScheme, admissionregistrationv1.AddToScheme, monitoringv1.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
	return k8sjson.NewSerializerWithOptions(k8sjson.DefaultMetaFactory, scheme, scheme,
		k8sjson.SerializerOptions{Yaml: true, Strict: true})
}()

// monitoringInstall is every object of a render (or of a kustomization) with monitoring.
type monitoringInstall struct {
	manifests       // the DaemonSet, the drivers file's ConfigMap, the service account, the node condition's objects
	dashboards      []*corev1.ConfigMap
	services        []*corev1.Service
	podMonitors     []*monitoringv1.PodMonitor
	serviceMonitors []*monitoringv1.ServiceMonitor
	rules           []*monitoringv1.PrometheusRule
}

// decodeMonitoring decodes every document of a stream strictly into its type. A ConfigMap
// with a .json entry is a dashboard; kinds other than these are errors.
func decodeMonitoring(b []byte) (monitoringInstall, error) {
	var m monitoringInstall
	docs, err := splitDocuments(b)
	if err != nil {
		return m, err
	}
	for i, doc := range docs {
		tm, err := typeOf(doc)
		if err != nil {
			return m, fmt.Errorf("document %d: %w", i+1, err)
		}
		gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
		obj, _, err := monitoringSerializer.Decode(doc, &gvk, nil)
		if err != nil {
			return m, fmt.Errorf("document %d: %s: %w", i+1, tm, err)
		}
		switch o := obj.(type) {
		case *appsv1.DaemonSet:
			m.daemonSets = append(m.daemonSets, o)
		case *corev1.ConfigMap:
			if slices.ContainsFunc(slices.Collect(maps.Keys(o.Data)), func(k string) bool { return strings.HasSuffix(k, ".json") }) {
				m.dashboards = append(m.dashboards, o)
			} else {
				m.configMaps = append(m.configMaps, o)
			}
		case *corev1.Service:
			m.services = append(m.services, o)
		case *monitoringv1.PodMonitor:
			m.podMonitors = append(m.podMonitors, o)
		case *monitoringv1.ServiceMonitor:
			m.serviceMonitors = append(m.serviceMonitors, o)
		case *monitoringv1.PrometheusRule:
			m.rules = append(m.rules, o)
		default:
			if !m.add(obj) {
				return m, fmt.Errorf("document %d: unexpected kind %q", i+1, tm)
			}
		}
	}
	return m, nil
}

func readRepoFile(t testing.TB, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ruleGroups is a rules file: what Prometheus loads, and a PrometheusRule's spec.
type ruleGroups struct {
	Groups []monitoringv1.RuleGroup `json:"groups"`
}

// sourceRules returns the rules file of charts/multireg/files, with the defaults replaced as
// the chart replaces them.
func sourceRules(t testing.TB, job, daemonSet, port, runbookURL string) []monitoringv1.RuleGroup {
	t.Helper()
	s := string(readRepoFile(t, rulesSource))
	s = strings.ReplaceAll(s, `job="`+defaultJob+`"`, `job="`+job+`"`)
	s = strings.ReplaceAll(s, `created_by_name="`+defaultDaemonSet+`"`, `created_by_name="`+daemonSet+`"`)
	s = strings.ReplaceAll(s, "--http-endpoint=:"+defaultHTTPPort, "--http-endpoint=:"+port)
	s = strings.ReplaceAll(s, defaultRunbookURL+"#", runbookURL+"#")
	var rf ruleGroups
	if err := yaml.UnmarshalStrict([]byte(s), &rf); err != nil {
		t.Fatalf("%s: %v", rulesSource, err)
	}
	return rf.Groups
}

var (
	promtoolOnce sync.Once
	promtoolPath string
	promtoolErr  error
)

// promtool returns Prometheus's promtool: $PROMTOOL if set (make monitoring sets it), else the
// one e2e/monitoring/build-promtool.sh builds, or has cached, in ~/.cache/multireg/promtool.
func promtool(t testing.TB) string {
	t.Helper()
	promtoolOnce.Do(func() {
		if p := os.Getenv("PROMTOOL"); p != "" {
			promtoolPath = p
			return
		}
		cmd := exec.Command(filepath.Join(repoRoot(t), "e2e", "monitoring", "build-promtool.sh"))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			promtoolErr = fmt.Errorf("build-promtool.sh: %v\n%s", err, stderr.String())
			return
		}
		promtoolPath = strings.TrimSpace(string(out))
	})
	if promtoolErr != nil {
		t.Fatal(promtoolErr)
	}
	return promtoolPath
}

// runPromtool runs promtool with args in dir and returns its output; it fails the test when
// promtool does.
func runPromtool(t testing.TB, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// checkRules writes groups as a rules file and runs `promtool check rules` on it.
func checkRules(t *testing.T, groups []monitoringv1.RuleGroup) {
	t.Helper()
	b, err := yaml.Marshal(ruleGroups{Groups: groups})
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(f, b, 0o600); err != nil {
		t.Fatal(err)
	}
	out := runPromtool(t, "", "check", "rules", f)
	t.Logf("promtool check rules:\n%s", out)
}

// runbookAnchors returns the anchors of docs/runbook.md's headings, as GitHub makes them.
func runbookAnchors(t testing.TB) map[string]bool {
	t.Helper()
	anchors := map[string]bool{}
	for line := range strings.SplitSeq(string(readRepoFile(t, runbook)), "\n") {
		if h, ok := strings.CutPrefix(line, "## "); ok {
			a := strings.ToLower(strings.TrimSpace(h))
			a = regexp.MustCompile(`[^a-z0-9 _-]`).ReplaceAllString(a, "")
			anchors[strings.ReplaceAll(a, " ", "-")] = true
		}
	}
	return anchors
}

// checkAlerts checks what an operator relies on in every alert: a severity, a summary, a
// description that names the node (and the driver, for a driver's alert), and a runbook_url
// into docs/runbook.md.
func checkAlerts(t *testing.T, groups []monitoringv1.RuleGroup, runbookURL string, extraLabels map[string]string) {
	t.Helper()
	anchors := runbookAnchors(t)
	n := 0
	for _, g := range groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			n++
			if s := r.Labels["severity"]; s != "warning" && s != "critical" && s != "info" {
				t.Errorf("%s: severity %q", r.Alert, s)
			}
			for k, v := range extraLabels {
				if r.Labels[k] != v {
					t.Errorf("%s: label %s=%q; want %q", r.Alert, k, r.Labels[k], v)
				}
			}
			if r.Annotations["summary"] == "" {
				t.Errorf("%s: no summary", r.Alert)
			}
			desc := r.Annotations["description"]
			if !strings.Contains(desc, "{{ $labels.node }}") {
				t.Errorf("%s: the description does not name the node: %q", r.Alert, desc)
			}
			if strings.Contains(r.Expr.String(), "multireg_driver") || strings.Contains(r.Expr.String(), "attempts_total") || strings.Contains(r.Expr.String(), "recreations_total") {
				if !strings.Contains(desc, "{{ $labels.driver }}") {
					t.Errorf("%s: the description does not name the driver: %q", r.Alert, desc)
				}
			}
			anchor := strings.ToLower(r.Alert)
			if got, want := r.Annotations["runbook_url"], runbookURL+"#"+anchor; got != want {
				t.Errorf("%s: runbook_url %q; want %q", r.Alert, got, want)
			}
			if !anchors[anchor] {
				t.Errorf("%s: %s has no heading %q", r.Alert, runbook, r.Alert)
			}
		}
	}
	if n == 0 {
		t.Fatal("no alert")
	}
}

// monitoringCases are chart renders with monitoring enabled: every object, and every knob set.
var monitoringCases = []struct {
	name   string
	values string
	// what the render must hold
	job, daemonSet, port, runbookURL string
	extraRuleLabels                  map[string]string
}{
	{
		name: "PodMonitor, alerts, dashboard",
		values: `
drivers:
  - {name: nfs.csi.k8s.io, type: CSIPlugin, endpoint: /var/lib/kubelet/plugins/csi-nfsplugin/csi.sock}
metrics:
  podMonitor:
    enabled: true
    labels: {release: kube-prometheus-stack}
    interval: 15s
    scrapeTimeout: 10s
    relabelings:
      - {sourceLabels: [__meta_kubernetes_pod_label_topology_kubernetes_io_zone], targetLabel: zone}
    metricRelabelings:
      - {sourceLabels: [__name__], regex: go_gc_duration_seconds.*, action: drop}
  prometheusRule:
    enabled: true
    labels: {release: kube-prometheus-stack}
    additionalRuleLabels: {team: storage}
    runbookBaseURL: https://forge.example/multireg/multireg/blob/v0.1.0/docs/runbook.md
  dashboard:
    enabled: true
    namespace: monitoring
    annotations: {grafana_folder: Kubernetes}
`,
		job: "multireg", daemonSet: "multireg", port: "9809", runbookURL: "https://forge.example/multireg/multireg/blob/v0.1.0/docs/runbook.md",
		extraRuleLabels: map[string]string{"team": "storage"},
	},
	{
		name: "ServiceMonitor, alerts with other names, port and runbook",
		values: `
nameOverride: noderegistrar
fullnameOverride: fleet-registrar
httpPort: 9810
metrics:
  serviceMonitor:
    enabled: true
    namespace: monitoring
    labels: {release: prom}
  prometheusRule:
    enabled: true
    namespace: monitoring
    runbookBaseURL: https://wiki.example/ops/multireg-runbook
  dashboard:
    enabled: true
`,
		job: "noderegistrar", daemonSet: "fleet-registrar", port: "9810", runbookURL: "https://wiki.example/ops/multireg-runbook",
	},
}

// TestMonitoringChart renders the chart with every monitoring object and decodes the result
// strictly into the Operator's types; then checks that the monitor scrapes multireg's pods on
// their http port with the node's name as `node` and the job the alerts select, that the
// alerts are the rules file's with the release's names (and pass `promtool check rules`), and
// that the dashboard is the chart's file.
func TestMonitoringChart(t *testing.T) {
	c := loadChart(t)
	dashboard := readRepoFile(t, dashboardSource)
	for _, tc := range monitoringCases {
		t.Run(tc.name, func(t *testing.T) {
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tc.values), &values); err != nil {
				t.Fatal(err)
			}
			out, err := renderChart(c, values)
			if err != nil {
				t.Fatal(err)
			}
			if os.Getenv("MONITORING_RENDER") != "" {
				t.Logf("helm template with these values:\n%s", out)
			}
			var lintValues map[string]any // lint coalesces the chart's defaults into its values
			if err := yaml.Unmarshal([]byte(tc.values), &lintValues); err != nil {
				t.Fatal(err)
			}
			for _, msg := range lint.All(chartDir(t), lintValues, releaseNamespace, true).Messages {
				if msg.Severity >= support.WarningSev {
					t.Errorf("helm lint --strict: %s", msg)
				}
			}
			m, err := decodeMonitoring([]byte(out))
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			d := checkDeployment(t, tc.name, m.manifests, expectations{root: kubeletRoot})
			if d.ds.Name != tc.daemonSet {
				t.Errorf("DaemonSet %q; want %q", d.ds.Name, tc.daemonSet)
			}
			if p := d.containerPort("http"); p != tc.port {
				t.Errorf("port http is %q; want %s", p, tc.port)
			}
			mon := values["metrics"].(map[string]any)
			switch {
			case len(m.podMonitors) == 1 && len(m.serviceMonitors) == 0 && len(m.services) == 0:
				pm := m.podMonitors[0]
				checkMonitorMeta(t, pm.ObjectMeta, mon["podMonitor"])
				if len(pm.Spec.PodMetricsEndpoints) != 1 {
					t.Fatalf("%d podMetricsEndpoints; want 1", len(pm.Spec.PodMetricsEndpoints))
				}
				e := pm.Spec.PodMetricsEndpoints[0]
				if e.Port == nil || *e.Port != "http" || e.Path != "/metrics" {
					t.Errorf("PodMonitor endpoint port %v path %q; want the pods' port http, /metrics", e.Port, e.Path)
				}
				checkScrape(t, "PodMonitor", e.Interval, e.ScrapeTimeout, e.RelabelConfigs, e.MetricRelabelConfigs, mon["podMonitor"])
				checkSelects(t, "PodMonitor", pm.Spec.Selector, &pm.Spec.NamespaceSelector, d.ds.Spec.Template.Labels, d.ds.Namespace)
				if job := d.ds.Spec.Template.Labels[pm.Spec.JobLabel]; job != tc.job {
					t.Errorf("PodMonitor jobLabel %q: the job is %q; want %q", pm.Spec.JobLabel, job, tc.job)
				}
			case len(m.serviceMonitors) == 1 && len(m.services) == 1 && len(m.podMonitors) == 0:
				sm, svc := m.serviceMonitors[0], m.services[0]
				checkMonitorMeta(t, sm.ObjectMeta, mon["serviceMonitor"])
				if len(sm.Spec.Endpoints) != 1 {
					t.Fatalf("%d endpoints; want 1", len(sm.Spec.Endpoints))
				}
				e := sm.Spec.Endpoints[0]
				if e.Port != "http" || e.Path != "/metrics" {
					t.Errorf("ServiceMonitor endpoint port %q path %q; want the Service's port http, /metrics", e.Port, e.Path)
				}
				checkScrape(t, "ServiceMonitor", e.Interval, e.ScrapeTimeout, e.RelabelConfigs, e.MetricRelabelConfigs, mon["serviceMonitor"])
				checkSelects(t, "ServiceMonitor", sm.Spec.Selector, &sm.Spec.NamespaceSelector, svc.Labels, svc.Namespace)
				if job := svc.Labels[sm.Spec.JobLabel]; job != tc.job {
					t.Errorf("ServiceMonitor jobLabel %q: the job is %q; want %q", sm.Spec.JobLabel, job, tc.job)
				}
				if svc.Spec.ClusterIP != corev1.ClusterIPNone || !svc.Spec.PublishNotReadyAddresses {
					t.Errorf("Service clusterIP %q publishNotReadyAddresses %v; want headless, with the pods that are not ready", svc.Spec.ClusterIP, svc.Spec.PublishNotReadyAddresses)
				}
				if svc.Namespace != d.ds.Namespace || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(d.ds.Spec.Template.Labels)) {
					t.Errorf("Service %s/%s selector %v does not select the pods %v", svc.Namespace, svc.Name, svc.Spec.Selector, d.ds.Spec.Template.Labels)
				}
				if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "http" || svc.Spec.Ports[0].TargetPort.String() != "http" || fmt.Sprint(svc.Spec.Ports[0].Port) != tc.port {
					t.Errorf("Service ports %+v; want http, %s, to the pods' port http", svc.Spec.Ports, tc.port)
				}
			default:
				t.Fatalf("%d PodMonitors, %d ServiceMonitors, %d Services; want one PodMonitor, or one ServiceMonitor and its Service",
					len(m.podMonitors), len(m.serviceMonitors), len(m.services))
			}

			if len(m.rules) != 1 {
				t.Fatalf("%d PrometheusRules; want 1", len(m.rules))
			}
			pr := m.rules[0]
			checkMonitorMeta(t, pr.ObjectMeta, mon["prometheusRule"])
			want := sourceRules(t, tc.job, tc.daemonSet, tc.port, tc.runbookURL)
			for _, g := range want {
				for i := range g.Rules {
					g.Rules[i].Labels = mergeLabels(tc.extraRuleLabels, g.Rules[i].Labels)
				}
			}
			if !reflect.DeepEqual(pr.Spec.Groups, want) {
				got, _ := yaml.Marshal(pr.Spec.Groups)
				w, _ := yaml.Marshal(want)
				t.Errorf("the PrometheusRule's groups are not %s with this release's values:\n%s\nwant:\n%s", rulesSource, got, w)
			}
			rendered := string(must(yaml.Marshal(pr.Spec)))
			for _, r := range []struct{ value, def, spelt string }{
				{tc.job, defaultJob, `job="` + defaultJob + `"`},
				{tc.daemonSet, defaultDaemonSet, `created_by_name="` + defaultDaemonSet + `"`},
				{tc.port, defaultHTTPPort, "--http-endpoint=:" + defaultHTTPPort},
				{tc.runbookURL, defaultRunbookURL, defaultRunbookURL},
			} {
				if r.value != r.def && strings.Contains(rendered, r.spelt) {
					t.Errorf("the PrometheusRule still says %s", r.spelt)
				}
			}
			checkAlerts(t, pr.Spec.Groups, tc.runbookURL, tc.extraRuleLabels)
			checkRules(t, pr.Spec.Groups)

			if len(m.dashboards) != 1 {
				t.Fatalf("%d dashboards; want 1", len(m.dashboards))
			}
			db := m.dashboards[0]
			checkMonitorMeta(t, db.ObjectMeta, mon["dashboard"])
			if db.Labels["grafana_dashboard"] != "1" {
				t.Errorf("dashboard labels %v; want grafana_dashboard=1, which Grafana's sidecar selects", db.Labels)
			}
			if got := db.Data["multireg.json"]; got != strings.TrimSuffix(string(dashboard), "\n") {
				t.Errorf("the dashboard ConfigMap's multireg.json is not %s", dashboardSource)
			}
			if ann := mon["dashboard"].(map[string]any)["annotations"]; ann != nil && !reflect.DeepEqual(toStringMap(ann), db.Annotations) {
				t.Errorf("dashboard annotations %v; want %v", db.Annotations, ann)
			}
		})
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func toStringMap(v any) map[string]string {
	m := map[string]string{}
	for k, v := range v.(map[string]any) {
		m[k] = fmt.Sprint(v)
	}
	return m
}

// mergeLabels returns extra and own together; own wins.
func mergeLabels(extra, own map[string]string) map[string]string {
	if len(extra) == 0 {
		return own
	}
	m := maps.Clone(extra)
	maps.Copy(m, own)
	return m
}

// checkMonitorMeta checks a monitoring object's namespace (its value's, or the release's) and
// that it carries the chart's labels and its value's labels.
func checkMonitorMeta(t *testing.T, meta metav1.ObjectMeta, values any) {
	t.Helper()
	v, _ := values.(map[string]any)
	wantNS := releaseNamespace
	if ns, _ := v["namespace"].(string); ns != "" {
		wantNS = ns
	}
	if meta.Namespace != wantNS {
		t.Errorf("%s: namespace %q; want %q", meta.Name, meta.Namespace, wantNS)
	}
	if meta.Labels["app.kubernetes.io/managed-by"] != "Helm" || meta.Labels["app.kubernetes.io/instance"] != releaseName {
		t.Errorf("%s: labels %v lack the chart's", meta.Name, meta.Labels)
	}
	if l, ok := v["labels"]; ok && l != nil {
		for k, val := range toStringMap(l) {
			if meta.Labels[k] != val {
				t.Errorf("%s: label %s=%q; want %q", meta.Name, k, meta.Labels[k], val)
			}
		}
	}
}

// nodeRelabeling is the relabeling that puts the node's name on every series.
var nodeRelabeling = monitoringv1.RelabelConfig{
	Action:       "replace",
	SourceLabels: []monitoringv1.LabelName{"__meta_kubernetes_pod_node_name"},
	TargetLabel:  "node",
}

// checkScrape checks a scrape endpoint: the node relabeling first, then the value's own, and
// the value's interval, timeout and metric relabelings.
func checkScrape(t *testing.T, what string, interval, timeout monitoringv1.Duration, relabelings, metricRelabelings []monitoringv1.RelabelConfig, values any) {
	t.Helper()
	v, _ := values.(map[string]any)
	if len(relabelings) == 0 || !reflect.DeepEqual(relabelings[0], nodeRelabeling) {
		t.Errorf("%s: relabelings %+v do not begin with %+v", what, relabelings, nodeRelabeling)
	}
	wantRelabel, _ := v["relabelings"].([]any)
	if len(relabelings) != 1+len(wantRelabel) {
		t.Errorf("%s: %d relabelings; want the node's and the %d of the values", what, len(relabelings), len(wantRelabel))
	}
	wantMetric, _ := v["metricRelabelings"].([]any)
	if len(metricRelabelings) != len(wantMetric) {
		t.Errorf("%s: %d metricRelabelings; want %d", what, len(metricRelabelings), len(wantMetric))
	}
	wantInterval, _ := v["interval"].(string)
	if wantInterval == "" {
		wantInterval = "30s"
	}
	if string(interval) != wantInterval {
		t.Errorf("%s: interval %q; want %q", what, interval, wantInterval)
	}
	if want, _ := v["scrapeTimeout"].(string); string(timeout) != want {
		t.Errorf("%s: scrapeTimeout %q; want %q", what, timeout, want)
	}
}

// checkSelects checks that a monitor's selector picks the objects with these labels, and its
// namespace selector (when not nil) their namespace alone.
func checkSelects(t *testing.T, what string, sel metav1.LabelSelector, ns *monitoringv1.NamespaceSelector, objLabels map[string]string, objNS string) {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(&sel)
	if err != nil {
		t.Fatal(err)
	}
	if s.Empty() || !s.Matches(labels.Set(objLabels)) {
		t.Errorf("%s: selector %q does not select %v", what, s, objLabels)
	}
	if ns != nil && (ns.Any || !reflect.DeepEqual(ns.MatchNames, []string{objNS})) {
		t.Errorf("%s: namespaceSelector %+v; want exactly %q", what, ns, objNS)
	}
}

// TestMonitoringOffByDefault: the chart installs without the Operator's CRDs, and ships no
// dashboard nobody asked for.
func TestMonitoringOffByDefault(t *testing.T) {
	out, err := renderChart(loadChart(t), map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeMonitoring([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(m.podMonitors) + len(m.serviceMonitors) + len(m.services) + len(m.rules) + len(m.dashboards); n != 0 {
		t.Errorf("%d monitoring objects by default; want none", n)
	}
}

// TestMonitoringChartRejects feeds the chart monitoring values it must refuse.
func TestMonitoringChartRejects(t *testing.T) {
	c := loadChart(t)
	tests := []renderCase{
		{"both monitors", "metrics: {podMonitor: {enabled: true}, serviceMonitor: {enabled: true}}", "enable one of them"},
		{"misspelt monitor", "metrics: {podmonitor: {enabled: true}}", "additional properties 'podmonitor' not allowed"},
		{"misspelt knob", "metrics: {prometheusRule: {enabled: true, runbookURL: x}}", "additional properties 'runbookURL' not allowed"},
		{"interval not a duration", "metrics: {podMonitor: {enabled: true, interval: 30 seconds}}", "at '/metrics/podMonitor/interval'"},
		{"relative runbook", "metrics: {prometheusRule: {enabled: true, runbookBaseURL: docs/runbook.md}}", "at '/metrics/prometheusRule/runbookBaseURL'"},
		{"runbook with an anchor", "metrics: {prometheusRule: {enabled: true, runbookBaseURL: 'https://x.example/runbook.md#top'}}", "at '/metrics/prometheusRule/runbookBaseURL'"},
		{"labels not strings", "metrics: {dashboard: {enabled: true, labels: {grafana_dashboard: 1}}}", "at '/metrics/dashboard/labels/grafana_dashboard'"},
		{"enabled not a boolean", "metrics: {dashboard: {enabled: yes please}}", "at '/metrics/dashboard/enabled'"},
		{"alerts without a runbook URL", "metrics: {prometheusRule: {enabled: true}}", "metrics.prometheusRule.runbookBaseURL is required"},
		{"everything but two monitors", "metrics: {podMonitor: {enabled: true}, prometheusRule: {enabled: true, runbookBaseURL: 'https://x.example/runbook.md'}, dashboard: {enabled: true}}", ""},
	}
	checkRenders(t, c, tests)
}

// TestPrometheusRules runs promtool on the rules file: `check rules`, and the unit tests of
// e2e/monitoring/alerts_test.yaml (every alert fires on its series and stays silent where it
// must). It checks the alerts' annotations against docs/runbook.md.
func TestPrometheusRules(t *testing.T) {
	root := repoRoot(t)
	out := runPromtool(t, root, "check", "rules", rulesSource)
	t.Logf("promtool check rules:\n%s", out)
	out = runPromtool(t, filepath.Join(root, filepath.Dir(alertTests)), "test", "rules", filepath.Base(alertTests))
	t.Logf("promtool test rules:\n%s", out)
	checkAlerts(t, sourceRules(t, defaultJob, defaultDaemonSet, defaultHTTPPort, defaultRunbookURL), defaultRunbookURL, nil)

	// Every alert has a unit test.
	tests := string(readRepoFile(t, alertTests))
	for _, g := range sourceRules(t, defaultJob, defaultDaemonSet, defaultHTTPPort, defaultRunbookURL) {
		for _, r := range g.Rules {
			if !strings.Contains(tests, "alertname: "+r.Alert+"\n") {
				t.Errorf("%s has no test in %s", r.Alert, alertTests)
			}
		}
	}
}

// TestPromtoolCatchesBrokenRules shows that the checks can fail: a rules file with a syntax
// error, and an alert whose unit test expects what it does not do.
func TestPromtoolCatchesBrokenRules(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("bad.yaml", "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: multireg_driver_registered ==\n")
	write("rules.yaml", "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: multireg_driver_registered == 0\n        for: 5m\n")
	write("test.yaml", `rule_files: [rules.yaml]
tests:
  - interval: 1m
    input_series:
      - {series: 'multireg_driver_registered{driver="a"}', values: '0x10'}
    alert_rule_test:
      - {eval_time: 10m, alertname: X, exp_alerts: []}
`)
	for _, args := range [][]string{{"check", "rules", "bad.yaml"}, {"test", "rules", "test.yaml"}} {
		cmd := exec.Command(promtool(t), args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err == nil {
			t.Errorf("promtool %s passed:\n%s", strings.Join(args, " "), out)
		}
	}
}

// dashboardQueries returns every PromQL query of the dashboard: each panel's targets (rows'
// panels too) and each query variable's label_values(…) selector.
func dashboardQueries(t testing.TB, b []byte) []string {
	t.Helper()
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	var queries []string
	var walk func(raw []json.RawMessage)
	walk = func(raw []json.RawMessage) {
		for _, p := range raw {
			var panel struct {
				Targets []struct {
					Expr string `json:"expr"`
				} `json:"targets"`
				Panels []json.RawMessage `json:"panels"`
			}
			if err := json.Unmarshal(p, &panel); err != nil {
				t.Fatal(err)
			}
			for _, tg := range panel.Targets {
				queries = append(queries, tg.Expr)
			}
			walk(panel.Panels)
		}
	}
	walk(d.Panels)
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Fatal(err)
		}
		m := labelValues.FindStringSubmatch(q.Query)
		if m == nil {
			t.Fatalf("variable query %q: not label_values(selector, label)", q.Query)
		}
		queries = append(queries, m[1])
	}
	return queries
}

// grafanaVariables are the dashboard's variables, as Grafana fills them in.
var grafanaVariables = strings.NewReplacer(
	"$__rate_interval", "2m",
	"$__interval", "1m",
	"$__range", "6h",
	`"$job"`, `"multireg"`,
	`"$node"`, `".*"`,
	`"$driver"`, `".*"`,
)

// TestDashboardQueriesParse gives every query of the dashboard, its variables filled in, to
// Prometheus's own parser (`promtool check rules`, each query a recording rule), and checks the
// dashboard's shape: a Prometheus data source variable, unique panel ids, nothing past the
// grid's 24 columns. That each query names only metrics multireg exports is checked against a
// live /metrics in e2e/registration (TestDashboardMetricsExist).
func TestDashboardQueriesParse(t *testing.T) {
	b := readRepoFile(t, dashboardSource)
	queries := dashboardQueries(t, b)
	if len(queries) < 10 {
		t.Fatalf("%d queries in the dashboard", len(queries))
	}
	var rules []monitoringv1.Rule
	for i, q := range queries {
		q = grafanaVariables.Replace(q)
		if strings.Contains(q, "$") {
			t.Errorf("query %d: a variable the test does not know: %s", i, q)
		}
		rules = append(rules, monitoringv1.Rule{Record: fmt.Sprintf("dashboard:query%d", i), Expr: intstr.FromString(q)})
	}
	checkRules(t, []monitoringv1.RuleGroup{{Name: "dashboard", Rules: rules}})

	var d struct {
		UID        string `json:"uid"`
		Title      string `json:"title"`
		Templating struct {
			List []struct {
				Name, Type string
				Query      json.RawMessage
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID         int                          `json:"id"`
			Type       string                       `json:"type"`
			Datasource map[string]string            `json:"datasource"`
			GridPos    struct{ H, W, X, Y int }     `json:"gridPos"`
			Targets    []map[string]json.RawMessage `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q title %q: the sidecar needs both", d.UID, d.Title)
	}
	if !slices.ContainsFunc(d.Templating.List, func(v struct {
		Name, Type string
		Query      json.RawMessage
	}) bool {
		return v.Name == "datasource" && v.Type == "datasource" && string(v.Query) == `"prometheus"`
	}) {
		t.Error("no Prometheus data source variable named datasource")
	}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos.X+p.GridPos.W > 24 || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("panel %d at %+v: outside the 24 columns, or empty", p.ID, p.GridPos)
		}
		if p.Type != "row" && p.Datasource["uid"] != "${datasource}" {
			t.Errorf("panel %d: data source %v; want the variable", p.ID, p.Datasource)
		}
	}
}
