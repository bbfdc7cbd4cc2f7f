package manifests

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// prometheusRuleHeader opens examples/monitoring/prometheusrule.yaml; the rules file follows,
// indented under spec.
const prometheusRuleHeader = `# GENERATED from charts/multireg/files/prometheus-rules.yaml by e2e/manifests
# (go test -run TestMonitoringExamples -update): edit that file, not this one.
# multireg's alerts as a PrometheusRule; what each means and what to do: docs/runbook.md. Your
# Prometheus must select it: its ruleSelector (kube-prometheus-stack: add the label
# release: <its release name>) and ruleNamespaceSelector. Its runbook links say RUNBOOK_URL:
# replace it with the URL of docs/runbook.md at your release's tag (or your copy), e.g.
#   sed -i 's|RUNBOOK_URL|https://<your forge>/<owner>/multireg/blob/<release tag>/docs/runbook.md|g' prometheusrule.yaml
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: multireg
  labels:
    app.kubernetes.io/name: multireg
    app.kubernetes.io/component: monitoring
spec:
`

// examplesGenerated returns the generated files of examples/monitoring, by name, from the
// chart's files: the rules file and the dashboard as they are, and the PrometheusRule made of
// the rules file.
func examplesGenerated(t testing.TB) map[string][]byte {
	t.Helper()
	rules := readRepoFile(t, rulesSource)
	var pr bytes.Buffer
	pr.WriteString(prometheusRuleHeader)
	for line := range strings.SplitAfterSeq(string(rules), "\n") {
		if strings.TrimSpace(line) != "" {
			pr.WriteString("  ")
		}
		pr.WriteString(line)
	}
	return map[string][]byte{
		"prometheus-rules.yaml": rules,
		"dashboard.json":        readRepoFile(t, dashboardSource),
		"prometheusrule.yaml":   pr.Bytes(),
	}
}

// TestMonitoringExamples checks examples/monitoring: its generated files are the chart's (with
// -update, it writes them), and the kustomize component, added to examples/, decodes strictly
// into the Operator's types, scrapes the examples' pods as the chart's PodMonitor does, and
// holds the chart's alerts and dashboard.
func TestMonitoringExamples(t *testing.T) {
	root := repoRoot(t)
	for name, want := range examplesGenerated(t) {
		path := filepath.Join(root, examplesMon, name)
		if *update {
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s/%s is not generated from charts/multireg/files: run go test -run TestMonitoringExamples -update in e2e/manifests", examplesMon, name)
		}
	}

	// examples/ with the component, as docs/monitoring.md says to add it.
	dir := t.TempDir()
	if err := os.CopyFS(dir, os.DirFS(filepath.Join(root, "examples"))); err != nil {
		t.Fatal(err)
	}
	k := filepath.Join(dir, "kustomization.yaml")
	b, err := os.ReadFile(k)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(k, append(b, "\ncomponents:\n  - monitoring\n"...), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := renderKustomization(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeMonitoring(out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	d := checkDeployment(t, "kubectl apply -k examples/ with components: [monitoring]", m.manifests, expectations{root: kubeletRoot})
	if len(m.podMonitors) != 1 || len(m.rules) != 1 || len(m.dashboards) != 1 || len(m.serviceMonitors)+len(m.services) != 0 {
		t.Fatalf("%d PodMonitors, %d PrometheusRules, %d dashboards, %d ServiceMonitors, %d Services; want one of the first three",
			len(m.podMonitors), len(m.rules), len(m.dashboards), len(m.serviceMonitors), len(m.services))
	}

	pm := m.podMonitors[0]
	if pm.Namespace != d.ds.Namespace || pm.Spec.NamespaceSelector.Any || len(pm.Spec.NamespaceSelector.MatchNames) > 0 {
		t.Errorf("PodMonitor in %q with namespaceSelector %+v; want the DaemonSet's namespace %q, and no other", pm.Namespace, pm.Spec.NamespaceSelector, d.ds.Namespace)
	}
	checkSelects(t, "PodMonitor", pm.Spec.Selector, nil, d.ds.Spec.Template.Labels, d.ds.Namespace)
	if job := d.ds.Spec.Template.Labels[pm.Spec.JobLabel]; job != defaultJob {
		t.Errorf("PodMonitor jobLabel %q: the job is %q; want %q, which the alerts select", pm.Spec.JobLabel, job, defaultJob)
	}
	// The same scrape as the chart's PodMonitor with its defaults.
	chartOut, err := renderChart(loadChart(t), map[string]any{"metrics": map[string]any{"podMonitor": map[string]any{"enabled": true}}})
	if err != nil {
		t.Fatal(err)
	}
	cm, err := decodeMonitoring([]byte(chartOut))
	if err != nil || len(cm.podMonitors) != 1 {
		t.Fatalf("the chart's PodMonitor: %v", err)
	}
	if got, want := pm.Spec.PodMetricsEndpoints, cm.podMonitors[0].Spec.PodMetricsEndpoints; !reflect.DeepEqual(got, want) {
		t.Errorf("the example's podMetricsEndpoints %+v differ from the chart's %+v", got, want)
	}
	if pm.Spec.JobLabel != cm.podMonitors[0].Spec.JobLabel {
		t.Errorf("jobLabel %q; the chart's %q", pm.Spec.JobLabel, cm.podMonitors[0].Spec.JobLabel)
	}

	if got, want := m.rules[0].Spec.Groups, sourceRules(t, defaultJob, d.ds.Name, d.containerPort("http"), defaultRunbookURL); !reflect.DeepEqual(got, want) {
		t.Errorf("the example's PrometheusRule is not %s", rulesSource)
	}
	checkRules(t, m.rules[0].Spec.Groups)

	db := m.dashboards[0]
	if db.Labels["grafana_dashboard"] != "1" || db.Namespace != d.ds.Namespace {
		t.Errorf("dashboard %s/%s labels %v; want grafana_dashboard=1", db.Namespace, db.Name, db.Labels)
	}
	if got := db.Data["multireg.json"]; got != string(readRepoFile(t, dashboardSource)) {
		t.Errorf("the dashboard ConfigMap's multireg.json is not %s", dashboardSource)
	}
}
