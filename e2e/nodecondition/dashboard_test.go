package nodecondition

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// The dashboard and the alerts that multireg ships (charts/multireg/files; examples/monitoring
// holds copies, checked equal in e2e/manifests).
var (
	dashboardFile = filepath.Join("..", "..", "charts", "multireg", "files", "dashboard.json")
	rulesFile     = filepath.Join("..", "..", "charts", "multireg", "files", "prometheus-rules.yaml")
)

// Metrics that the queries may name and multireg does not export: Prometheus's own up (every
// target), and kube-state-metrics' kube_pod_info (one alert's "not scraped" half).
var notMultiregs = map[string][]string{
	"dashboard": {"up"},
	"alerts":    {"up", "kube_pod_info"},
}

// TestDashboardMetricsExist runs the built multireg with real drivers against kubelet's plugin
// manager, with the node condition on (a real API server: this package's), and reads its
// /metrics; every metric that a query of the dashboard or an alert names must be there. A query that names a metric multireg does not export (a typo, a renamed
// metric) would show an empty panel, or an alert that never fires.
func TestDashboardMetricsExist(t *testing.T) {
	t.Parallel()
	queries := map[string][]string{"dashboard": dashboardQueries(t), "alerts": ruleQueries(t)}

	n := newNode(t)
	good := driver{Name: "good.csi.example.com", Type: "CSIPlugin"}
	gone := driver{Name: "example.com/fpga", Type: "DevicePlugin"} // absent from this node
	n.StartEndpoints([]driver{good})
	start := time.Now()
	p := n.start([]driver{good, gone})
	n.await("the condition True (the CSI driver listed in CSINode)", start, isTrue)
	exported := exportedMetrics(p.Metrics(t))
	for _, want := range []string{"multireg_driver_phase", "multireg_config_generation", "multireg_build_info", "process_resident_memory_bytes", "go_goroutines"} {
		if !exported[want] {
			t.Fatalf("/metrics lacks %s: the test does not read it right", want)
		}
	}

	for what, qs := range queries {
		named := 0
		for _, q := range qs {
			names := metricNames(q)
			named += len(names)
			for _, n := range names {
				if !exported[n] && !slices.Contains(notMultiregs[what], n) {
					t.Errorf("%s: the query names %s, which multireg does not export:\n%s", what, n, q)
				}
			}
		}
		t.Logf("%s: %d queries, %d metric names, all exported", what, len(qs), named)
		if named < len(qs) {
			t.Errorf("%s: %d metric names in %d queries: the test does not read them right", what, named, len(qs))
		}
	}
}

// TestMetricNames shows that the test finds the metrics a query names, and only those.
func TestMetricNames(t *testing.T) {
	tests := []struct {
		give string
		want []string
	}{
		{`sum by (node, driver, result) (increase(multireg_registration_attempts_total{job="$job", node=~"$node"}[$__rate_interval])) > 0`, []string{"multireg_registration_attempts_total"}},
		{"(multireg_driver_registered == 0)\nand ignoring (type)\n(multireg_endpoint_up == 1)", []string{"multireg_driver_registered", "multireg_endpoint_up"}},
		{`time() - max by (node, driver) (max_over_time(timestamp(increase(x_total{result="registered"}[2m]) > 0)[1d:1m]))`, []string{"x_total"}},
		{`count(up{job="$job"} == 0) or vector(0)`, []string{"up"}},
		{`go_gc_gomemlimit_bytes{node=~"$node"} < 2^62 unless on (namespace, pod) kube_pod_info offset 5m`, []string{"go_gc_gomemlimit_bytes", "kube_pod_info"}},
		{`{__name__="multireg_config_generation"}`, []string{"multireg_config_generation"}},
		{`multireg_driver_typo{driver="a"}`, []string{"multireg_driver_typo"}},
	}
	for _, tt := range tests {
		if got := metricNames(tt.give); !slices.Equal(got, tt.want) {
			t.Errorf("metricNames(%q) = %q; want %q", tt.give, got, tt.want)
		}
	}
	exported := exportedMetrics("# HELP a_total x\n# TYPE a_total counter\na_total 1\n# TYPE h histogram\nh_bucket{le=\"1\"} 0\n")
	for n, want := range map[string]bool{"a_total": true, "h_bucket": true, "h_sum": true, "h_count": true, "multireg_driver_typo": false} {
		if exported[n] != want {
			t.Errorf("exported[%s] = %v; want %v", n, exported[n], want)
		}
	}
}

// dashboardQueries returns the PromQL of every panel's targets (rows' panels too) and the
// selector of every variable's label_values(…).
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"` // a string for a data source variable
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	var qs []string
	var walk func([]json.RawMessage)
	walk = func(ps []json.RawMessage) {
		for _, raw := range ps {
			var p panel
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatal(err)
			}
			for _, tg := range p.Targets {
				qs = append(qs, tg.Expr)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*[a-zA-Z_]\w*\)$`)
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
		qs = append(qs, m[1])
	}
	if len(qs) == 0 {
		t.Fatal("no query in the dashboard")
	}
	return qs
}

// ruleQueries returns the expression of every rule of the rules file.
func ruleQueries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Rules []struct {
				Expr string `json:"expr"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	var qs []string
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			qs = append(qs, r.Expr)
		}
	}
	if len(qs) == 0 {
		t.Fatal("no rule in the rules file")
	}
	return qs
}

var (
	promqlStrings   = regexp.MustCompile(`"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|` + "`[^`]*`")
	promqlNameLabel = regexp.MustCompile(`__name__\s*=\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"`)
	promqlMatchers  = regexp.MustCompile(`\{[^}]*\}`)
	promqlGrouping  = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promqlRanges    = regexp.MustCompile(`\[[^\]]*\]|\boffset\s+-?[0-9a-z]+`)
	promqlIdent     = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	promqlKeywords  = []string{"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "inf", "nan", "atan2"}
)

// metricNames returns the metrics a PromQL query names, in order, each once: the identifiers
// outside label matchers, grouping lists, ranges and strings that are not functions,
// aggregations or keywords, and the names of __name__ matchers. Grafana's variables ($node,
// $__rate_interval) stand in matchers and ranges only.
func metricNames(q string) []string {
	var names []string
	add := func(n string) {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	for _, m := range promqlNameLabel.FindAllStringSubmatch(q, -1) {
		add(m[1])
	}
	q = promqlMatchers.ReplaceAllString(q, " ")
	q = promqlStrings.ReplaceAllString(q, " ")
	q = promqlGrouping.ReplaceAllString(q, " ")
	q = promqlRanges.ReplaceAllString(q, " ")
	for _, loc := range promqlIdent.FindAllStringIndex(q, -1) {
		id := q[loc[0]:loc[1]]
		if loc[0] > 0 && (q[loc[0]-1] >= '0' && q[loc[0]-1] <= '9' || q[loc[0]-1] == '.') {
			continue // the exponent or unit of a number
		}
		if slices.Contains(promqlKeywords, strings.ToLower(id)) {
			continue
		}
		if rest := strings.TrimLeft(q[loc[1]:], " \t\n"); strings.HasPrefix(rest, "(") {
			continue // a function or an aggregation
		}
		add(id)
	}
	return names
}

// exportedMetrics returns the metric names of a Prometheus text exposition: each sample's name,
// and each family's with the suffixes of its type (a histogram's _bucket, _sum, _count).
func exportedMetrics(text string) map[string]bool {
	names := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			f := strings.Fields(rest)
			if len(f) != 2 {
				continue
			}
			names[f[0]] = true
			switch f[1] {
			case "histogram":
				names[f[0]+"_bucket"], names[f[0]+"_sum"], names[f[0]+"_count"] = true, true, true
			case "summary":
				names[f[0]+"_sum"], names[f[0]+"_count"] = true, true
			}
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
	}
	return names
}
