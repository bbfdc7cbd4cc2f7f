package manifests

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

const (
	releaseName      = "multireg"
	releaseNamespace = "kube-system"
	k3sKubeletDir    = "/var/lib/rancher/k3s/agent/kubelet"
)

func chartDir(t testing.TB) string { return filepath.Join(repoRoot(t), "charts", "multireg") }

func loadChart(t testing.TB) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir(t))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// readValues reads a values file of testdata/ ("" for none).
func readValues(t testing.TB, file string) map[string]any {
	t.Helper()
	if file == "" {
		return map[string]any{}
	}
	v, err := chartutil.ReadValuesFile(filepath.Join("testdata", file))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// renderChart is `helm template` with Helm's own Go packages: values coalesced with the chart's
// and checked against values.schema.json, then every template rendered in strict mode (a
// reference to a value that does not exist is an error). It returns the rendered manifests.
func renderChart(c *chart.Chart, values map[string]any) (string, error) {
	files, err := renderFiles(c, values)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(files)) {
		// The chart's test pod is created by `helm test` only, as helm install leaves it out.
		if strings.HasSuffix(name, ".yaml") && !strings.Contains(name, "/templates/tests/") {
			fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", name, files[name])
		}
	}
	return b.String(), nil
}

// renderFiles renders the chart as `helm template` does, into its files by name.
func renderFiles(c *chart.Chart, values map[string]any) (map[string]string, error) {
	return renderFilesFor(c, values, chartutil.DefaultCapabilities)
}

// renderFilesFor is renderFiles for a cluster of the given capabilities (its Kubernetes
// version: helm template's --kube-version).
func renderFilesFor(c *chart.Chart, values map[string]any, caps *chartutil.Capabilities) (map[string]string, error) {
	opts := chartutil.ReleaseOptions{Name: releaseName, Namespace: releaseNamespace, Revision: 1, IsInstall: true}
	vals, err := chartutil.ToRenderValues(c, values, opts, caps)
	if err != nil {
		return nil, err
	}
	return engine.Engine{Strict: true}.Render(c, vals)
}

// chartCases are the renders every chart test checks.
var chartCases = []struct {
	name   string
	values string // in testdata/; "" for the chart's defaults
	want   expectations
}{
	{"default values", "", expectations{root: kubeletRoot}},
	{"the examples' drivers", "values-drivers.yaml", expectations{root: kubeletRoot}},
	{"k3s", "values-k3s.yaml", expectations{root: k3sKubeletDir}},
	{"roll on config change", "values-roll.yaml", expectations{root: kubeletRoot, rollOnConfigChange: true}},
	{"old pod first", "values-old-pod-first.yaml", expectations{root: kubeletRoot, noSurge: true}},
	{"every field", "values-every-field.yaml", expectations{root: kubeletRoot}},
	{"health checks", "values-health-checks.yaml", expectations{root: kubeletRoot, healthChecks: true}},
}

// TestChartRender renders the chart with each set of values and checks every document: strict
// decoding into its k8s.io/api type, the deployment contract (for k3s: every path under its
// kubelet root), multireg's validation of the rendered drivers file, that file's drivers and
// defaults equal to the values', and the standard labels.
func TestChartRender(t *testing.T) {
	c := loadChart(t)
	for _, tc := range chartCases {
		t.Run(tc.name, func(t *testing.T) {
			values := readValues(t, tc.values)
			out, err := renderChart(c, values)
			if err != nil {
				t.Fatal(err)
			}
			m, err := decodeManifests([]byte(out))
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			d := checkDeployment(t, "helm template", m, tc.want)

			var cfg driversFile
			if err := yaml.Unmarshal(d.config, &cfg); err != nil {
				t.Fatal(err)
			}
			drivers, _ := values["drivers"].([]any)
			if len(cfg.Drivers) != len(drivers) {
				t.Errorf("the drivers file has %d drivers; the values %d", len(cfg.Drivers), len(drivers))
			}
			var rendered map[string]any
			if err := yaml.Unmarshal(d.config, &rendered); err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"drivers", "defaults"} {
				got, want := rendered[key], values[key]
				if key == "drivers" && want == nil {
					want = []any{}
				}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("the drivers file's %s:\n%s\nthe values':\n%s", key, toYAML(t, got), toYAML(t, want))
				}
			}

			want := map[string]string{
				"app.kubernetes.io/name":       "multireg",
				"app.kubernetes.io/instance":   releaseName,
				"app.kubernetes.io/version":    c.Metadata.AppVersion,
				"app.kubernetes.io/component":  "registrar",
				"app.kubernetes.io/managed-by": "Helm",
				"helm.sh/chart":                "multireg-" + c.Metadata.Version,
			}
			for _, obj := range []struct {
				what   string
				labels map[string]string
			}{{"DaemonSet", d.ds.Labels}, {"ConfigMap", d.cm.Labels}} {
				for k, v := range want {
					if obj.labels[k] != v {
						t.Errorf("%s label %s=%q; want %q", obj.what, k, obj.labels[k], v)
					}
				}
				for k, v := range obj.labels {
					if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
						t.Errorf("%s label %s=%q: %s", obj.what, k, v, strings.Join(errs, "; "))
					}
				}
			}
			if d.ds.Namespace != releaseNamespace || d.cm.Namespace != releaseNamespace {
				t.Errorf("namespaces %q, %q; want the release's, %q", d.ds.Namespace, d.cm.Namespace, releaseNamespace)
			}
			if img := d.container.Image; !strings.HasSuffix(img, ":"+c.Metadata.AppVersion) {
				t.Errorf("image %q; want the tag to default to appVersion %s", img, c.Metadata.AppVersion)
			}
		})
	}
}

// TestChartLint is `helm lint --strict`: a warning fails too.
func TestChartLint(t *testing.T) {
	for _, tc := range chartCases {
		t.Run(tc.name, func(t *testing.T) {
			l := lint.All(chartDir(t), readValues(t, tc.values), releaseNamespace, true)
			for _, msg := range l.Messages {
				if msg.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", msg)
				} else {
					t.Logf("helm lint: %s", msg)
				}
			}
		})
	}
}

// TestChartRejects feeds the chart values it must refuse: values.schema.json catches shapes, the
// templates catch endpoints that the pod could not reach.
func TestChartRejects(t *testing.T) {
	c := loadChart(t)
	driver := func(extra string) string {
		return "drivers:\n  - name: nfs.csi.k8s.io\n    type: CSIPlugin\n    endpoint: /var/lib/kubelet/plugins/csi-nfsplugin/csi.sock\n" + extra
	}
	tests := []renderCase{
		{"valid", driver(""), ""},
		{"relative kubeletDir", "kubeletDir: var/lib/kubelet\n", "at '/kubeletDir'"},
		{"kubeletDir with trailing slash", "kubeletDir: /var/lib/kubelet/\n" + driver(""), ""},
		{"kubeletDir /", "kubeletDir: /\n", "at '/kubeletDir'"},
		{"kubeletDir //", "kubeletDir: //\n", "at '/kubeletDir'"},
		{"unknown value", "kubeletdir: /var/lib/kubelet\n", "additional properties 'kubeletdir' not allowed"},
		{"unknown driver type", strings.Replace(driver(""), "CSIPlugin", "CSI", 1), "at '/drivers/0/type'"},
		{"misspelt driver field", driver("    socketname: x.sock\n"), "additional properties 'socketname' not allowed"},
		{"relative endpoint", strings.Replace(driver(""), "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock", "csi.sock", 1), "at '/drivers/0/endpoint'"},
		{"missing endpoint", "drivers:\n  - name: nfs.csi.k8s.io\n    type: CSIPlugin\n", "missing property 'endpoint'"},
		{"bad duration", driver("    backoff: {maxInterval: 2 minutes}\n"), "at '/drivers/0/backoff/maxInterval'"},
		{"multiplier below 1", driver("    backoff: {multiplier: 0.5}\n"), "at '/drivers/0/backoff/multiplier'"},
		{"bad pull policy", "image: {repository: x, pullPolicy: Sometimes}\n", "at '/image/pullPolicy'"},
		{"port out of range", "httpPort: 70000\n", "at '/httpPort'"},
		{"drivers not a list", "drivers: {name: x}\n", "at '/drivers': got object, want array"},
		{"misspelt maxSurge", "updateStrategy: {type: RollingUpdate, rollingUpdate: {maxsurge: 0}}\n", "additional properties 'maxsurge' not allowed"},
		{"negative maxSurge", "updateStrategy: {type: RollingUpdate, rollingUpdate: {maxSurge: -1}}\n", "at '/updateStrategy/rollingUpdate/maxSurge'"},
		{"maxUnavailable not a percentage", "updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: half}}\n", "at '/updateStrategy/rollingUpdate/maxUnavailable'"},
		{"surge in percent", "updateStrategy: {type: RollingUpdate, rollingUpdate: {maxSurge: 10%}}\n", ""},
		{
			"endpoint outside the k3s root",
			"kubeletDir: " + k3sKubeletDir + "\n" + driver(""),
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock" is not under /var/lib/rancher/k3s/agent/kubelet/plugins`,
		},
		{"localEndpoint outside", driver("    localEndpoint: /csi/csi.sock\n"), `drivers[0].localEndpoint: "/csi/csi.sock" is not under`},
		{"endpoint under an extra host path", "extraHostPaths: [/run/csi]\n" + strings.Replace(driver(""), "/var/lib/kubelet/plugins/csi-nfsplugin", "/run/csi", 1), ""},
		{"endpoint under an extra host path with a trailing slash", "extraHostPaths: [/run/csi/]\n" + strings.Replace(driver(""), "/var/lib/kubelet/plugins/csi-nfsplugin", "/run/csi", 1), ""},
		{"extra host path /", "extraHostPaths: [/]\n", "at '/extraHostPaths/0'"},
		{"extra host path relative", "extraHostPaths: [run/csi]\n", "at '/extraHostPaths/0'"},
		{"extra host path: the plugins directory", "extraHostPaths: [/run/csi, /var/lib/kubelet/plugins]\n",
			`extraHostPaths[1]: "/var/lib/kubelet/plugins" is mounted by the chart already`},
		{"extra host path: the plugins directory with a trailing slash", "extraHostPaths: [/var/lib/kubelet/plugins/]\n",
			`extraHostPaths[0]: "/var/lib/kubelet/plugins/" is mounted by the chart already`},
		{"extra host path: the registration directory", "extraHostPaths: [/var/lib/kubelet/plugins_registry]\n",
			`extraHostPaths[0]: "/var/lib/kubelet/plugins_registry" is mounted by the chart already`},
		{"extra host path: the ConfigMap's directory", "extraHostPaths: [/etc/multireg]\n",
			`extraHostPaths[0]: "/etc/multireg" is mounted by the chart already`},
		{"extra host path: the k3s plugins directory", "kubeletDir: " + k3sKubeletDir + "/\nextraHostPaths: [" + k3sKubeletDir + "/plugins]\n",
			`extraHostPaths[0]: "` + k3sKubeletDir + `/plugins" is mounted by the chart already`},
		{"extra host path twice", "extraHostPaths: [/run/csi, /opt/dp, /run/csi]\n", `extraHostPaths[2]: "/run/csi" is extraHostPaths[0] again`},
		{"extra host path twice, once with a trailing slash", "extraHostPaths: [/run/csi, /run/csi/]\n", `extraHostPaths[1]: "/run/csi/" is extraHostPaths[0] again`},
		{"extra host path with its type", "extraHostPaths: [{path: /run/csi, type: DirectoryOrCreate}, {path: /opt/dp, type: Directory}, {path: /run/x}]\n", ""},
		{"endpoint under an extra host path with its type", "extraHostPaths: [{path: /run/csi/, type: DirectoryOrCreate}]\n" + strings.Replace(driver(""), "/var/lib/kubelet/plugins/csi-nfsplugin", "/run/csi", 1), ""},
		{"extra host path of a misspelt type", "extraHostPaths: [{path: /run/csi, type: Directroy}]\n", "at '/extraHostPaths/0'"},
		{"extra host path of a type not a directory", "extraHostPaths: [{path: /run/csi/csi.sock, type: Socket}]\n", "at '/extraHostPaths/0'"},
		{"extra host path of an empty type", "extraHostPaths: [{path: /run/csi, type: ''}]\n", "at '/extraHostPaths/0'"},
		{"extra host path without its path", "extraHostPaths: [{type: Directory}]\n", "at '/extraHostPaths/0'"},
		{"extra host path relative, with its type", "extraHostPaths: [{path: run/csi, type: Directory}]\n", "at '/extraHostPaths/0'"},
		{"extra host path with a misspelt field", "extraHostPaths: [{path: /run/csi, typ: Directory}]\n", "at '/extraHostPaths/0'"},
		{"extra host path with its type, twice", "extraHostPaths: [/run/csi, {path: /run/csi/, type: DirectoryOrCreate}]\n", `extraHostPaths[1]: "/run/csi/" is extraHostPaths[0] again`},
		{"extra host path with its type: the ConfigMap's directory", "extraHostPaths: [{path: /etc/multireg, type: Directory}]\n",
			`extraHostPaths[0]: "/etc/multireg" is mounted by the chart already`},
	}
	checkRenders(t, c, tests)
}

// renderCase is a render of the chart with values (YAML) that must fail with an error
// containing want, or succeed when want is empty.
type renderCase struct {
	name, values, want string
}

func checkRenders(t *testing.T, c *chart.Chart, tests []renderCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tt.values), &values); err != nil {
				t.Fatal(err)
			}
			_, err := renderChart(c, values)
			checkErr(t, err, tt.want)
		})
	}
}

// TestChartConfigEditDoesNotRoll changes only the drivers: the DaemonSet must render byte for
// byte the same (no pod restarts; multireg reloads the ConfigMap), unless rollOnConfigChange.
func TestChartConfigEditDoesNotRoll(t *testing.T) {
	c := loadChart(t)
	tests := []struct {
		roll     bool
		wantSame bool
	}{{false, true}, {true, false}}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("rollOnConfigChange=%v", tt.roll), func(t *testing.T) {
			render := func(drivers string) (ds, cm string) {
				var values map[string]any
				if err := yaml.Unmarshal(fmt.Appendf(nil, "rollOnConfigChange: %v\n%s", tt.roll, drivers), &values); err != nil {
					t.Fatal(err)
				}
				out, err := renderChart(c, values)
				if err != nil {
					t.Fatal(err)
				}
				for _, doc := range strings.Split(out, "\n---\n") {
					switch {
					case strings.Contains(doc, "\nkind: DaemonSet\n"):
						ds = doc
					case strings.Contains(doc, "\nkind: ConfigMap\n"):
						cm = doc
					}
				}
				if ds == "" || cm == "" {
					t.Fatalf("no DaemonSet or ConfigMap in\n%s", out)
				}
				return ds, cm
			}
			ds1, cm1 := render("drivers:\n  - {name: nfs.csi.k8s.io, type: CSIPlugin, endpoint: /var/lib/kubelet/plugins/csi-nfsplugin/csi.sock}\n")
			ds2, cm2 := render("drivers:\n  - {name: smb.csi.k8s.io, type: CSIPlugin, endpoint: /var/lib/kubelet/plugins/smb.csi.k8s.io/csi.sock}\n")
			if cm1 == cm2 {
				t.Fatal("the ConfigMap did not change with the drivers")
			}
			if same := ds1 == ds2; same != tt.wantSame {
				t.Errorf("DaemonSet unchanged: %v; want %v", same, tt.wantSame)
			}
		})
	}
}

// TestChartValuesDocumentKubeletRoots keeps values.yaml's list of kubelet roots honest: each
// renders, and every path follows it.
func TestChartValuesDocumentKubeletRoots(t *testing.T) {
	c := loadChart(t)
	doc, err := os.ReadFile(filepath.Join(chartDir(t), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, root := range []string{kubeletRoot, k3sKubeletDir, "/var/lib/k0s/kubelet", "/var/snap/microk8s/common/var/lib/kubelet"} {
		t.Run(root, func(t *testing.T) {
			if !strings.Contains(string(doc), root) {
				t.Errorf("values.yaml does not mention %s", root)
			}
			out, err := renderChart(c, map[string]any{
				"kubeletDir": root,
				"drivers": []any{map[string]any{
					"name": "nfs.csi.k8s.io", "type": "CSIPlugin", "endpoint": root + "/plugins/csi-nfsplugin/csi.sock",
				}},
			})
			if err != nil {
				t.Fatal(err)
			}
			m, err := decodeManifests([]byte(out))
			if err != nil {
				t.Fatal(err)
			}
			checkDeployment(t, "helm template --set kubeletDir="+root, m, expectations{root: root})
		})
	}
}
