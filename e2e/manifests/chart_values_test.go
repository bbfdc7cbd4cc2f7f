package manifests

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	kyaml "sigs.k8s.io/kustomize/kyaml/yaml"
	"sigs.k8s.io/yaml"
)

// toYAML is v in YAML, for messages.
func toYAML(t testing.TB, v any) string {
	t.Helper()
	b, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// mustValues reads values written in YAML.
func mustValues(t testing.TB, s string) map[string]any {
	t.Helper()
	var v map[string]any
	if err := yaml.Unmarshal([]byte(s), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// fields returns the keys of the mapping at path in the YAML document doc, in the order
// written; nil when there is none.
func fields(t testing.TB, doc *kyaml.RNode, path ...string) []string {
	t.Helper()
	n, err := doc.Pipe(kyaml.Lookup(path...))
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(path, "."), err)
	}
	if n == nil {
		return nil
	}
	f, err := n.Fields()
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(path, "."), err)
	}
	return f
}

// schemaOrder returns the properties of the mapping at path in values.schema.json, in the order
// written there.
func schemaOrder(t testing.TB, path ...string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir(t), "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := kyaml.Parse(string(b))
	if err != nil {
		t.Fatal(err)
	}
	f := fields(t, doc, path...)
	if len(f) == 0 {
		t.Fatalf("values.schema.json has no %s", strings.Join(path, "."))
	}
	return f
}

// inOrder reports whether keys appear in order, each of them in it.
func inOrder(keys, order []string) bool {
	last := -1
	for _, k := range keys {
		i := slices.Index(order, k)
		if i <= last {
			return false
		}
		last = i
	}
	return true
}

// TestChartDriversFileOrder checks that the rendered drivers file writes each driver's keys, the
// defaults' and every backoff's in the order of values.schema.json (name, type, endpoint, …),
// whatever the order of the values (toYaml would sort them: backoff, endpoint, name, …), and
// that this order is the one docs/drivers-file.md writes.
func TestChartDriversFileOrder(t *testing.T) {
	driverOrder := schemaOrder(t, "definitions", "driver", "properties")
	backoffOrder := schemaOrder(t, "definitions", "backoff", "properties")
	defaultsOrder := schemaOrder(t, "properties", "defaults", "properties")
	if want := []string{"name", "type", "endpoint"}; !slices.Equal(driverOrder[:3], want) {
		t.Errorf("values.schema.json: a driver's properties begin with %q; want %q", driverOrder[:3], want)
	}

	t.Run("DriversFileDoc", func(t *testing.T) {
		page, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "drivers-file.md"))
		if err != nil {
			t.Fatal(err)
		}
		_, section, ok := strings.Cut(string(page), "# The drivers file\n")
		_, block, ok2 := strings.Cut(section, "```yaml\n")
		block, _, ok3 := strings.Cut(block, "```")
		if !ok || !ok2 || !ok3 {
			t.Fatal(`docs/drivers-file.md: no yaml block under "# The drivers file"`)
		}
		doc, err := kyaml.Parse(block)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			what  string
			keys  []string
			order []string
		}{
			{"a driver", fields(t, doc, "drivers", "[name=nfs.csi.k8s.io]"), driverOrder},
			{"defaults", fields(t, doc, "defaults"), defaultsOrder},
			{"defaults.backoff", fields(t, doc, "defaults", "backoff"), backoffOrder},
		} {
			if len(c.keys) == 0 || !inOrder(c.keys, c.order) {
				t.Errorf("docs/drivers-file.md's drivers file writes %s as %q; values.schema.json orders them %q", c.what, c.keys, c.order)
			}
		}
	})

	c := loadChart(t)
	d, _ := renderChartDeployment(t, c, readValues(t, "values-every-field.yaml"))
	doc, err := kyaml.Parse(d.cm.Data["config.yaml"])
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fields(t, doc), []string{"apiVersion", "kind", "registrationDir", "defaults", "drivers"}; !slices.Equal(got, want) {
		t.Errorf("the drivers file's keys %q; want %q", got, want)
	}
	check := func(what string, order []string, n *kyaml.RNode, path ...string) {
		got := fields(t, n, path...)
		want := slices.DeleteFunc(slices.Clone(order), func(k string) bool { return !slices.Contains(got, k) })
		if len(got) == 0 || !slices.Equal(got, want) {
			t.Errorf("%s: keys %q; want the schema's order %q\n%s", what, got, want, d.cm.Data["config.yaml"])
		}
	}
	check("defaults", defaultsOrder, doc, "defaults")
	check("defaults.backoff", backoffOrder, doc, "defaults", "backoff")
	drivers, err := doc.Pipe(kyaml.Lookup("drivers"))
	if err != nil {
		t.Fatal(err)
	}
	elems, err := drivers.Elements()
	if err != nil || len(elems) != 3 {
		t.Fatalf("drivers: %d elements, %v; want 3", len(elems), err)
	}
	for i, e := range elems {
		check(fmt.Sprintf("drivers[%d]", i), driverOrder, e)
		if i == 0 {
			check("drivers[0].backoff", backoffOrder, e, "backoff")
		}
	}
}

// TestChartExtraHostPathTypes: an extraHostPaths entry is mounted as a hostPath of type
// Directory, so that a mistyped path keeps the pod from starting instead of being created on
// every node, unless the entry says DirectoryOrCreate.
func TestChartExtraHostPathTypes(t *testing.T) {
	c := loadChart(t)
	for _, tt := range []struct {
		values string
		want   []string // path and type of each extra volume
	}{
		{"extraHostPaths: [/run/csi, /opt/dp/]", []string{"/run/csi Directory", "/opt/dp Directory"}},
		{"extraHostPaths: [{path: /run/csi/}, {path: /opt/dp, type: Directory}]", []string{"/run/csi Directory", "/opt/dp Directory"}},
		{"extraHostPaths: [{path: /run/csi, type: DirectoryOrCreate}, /opt/dp]", []string{"/run/csi DirectoryOrCreate", "/opt/dp Directory"}},
	} {
		d, _ := renderChartDeployment(t, c, mustValues(t, tt.values))
		var got []string
		for _, v := range d.ds.Spec.Template.Spec.Volumes {
			if strings.HasPrefix(v.Name, "extra-") {
				if v.HostPath == nil || v.HostPath.Type == nil {
					t.Fatalf("%s: volume %s: %+v, want a hostPath with a type", tt.values, v.Name, v.VolumeSource)
				}
				got = append(got, v.HostPath.Path+" "+string(*v.HostPath.Type))
			}
		}
		if strings.Join(got, ", ") != strings.Join(tt.want, ", ") {
			t.Errorf("%s: volumes %q; want %q", tt.values, got, tt.want)
		}
		var mounts []string
		for _, m := range d.container.VolumeMounts {
			if strings.HasPrefix(m.Name, "extra-") && m.ReadOnly {
				mounts = append(mounts, m.MountPath)
			}
		}
		if len(mounts) != len(tt.want) || !strings.HasPrefix(tt.want[0], mounts[0]+" ") {
			t.Errorf("%s: read-only mounts %q; want one per entry at its path", tt.values, mounts)
		}
	}
}

// TestChartNormalisesSlashes renders kubeletDir and extraHostPaths with trailing slashes: the
// chart renders exactly what it renders without them (a trailing slash is no different
// directory), instead of refusing them or writing "//" into the paths.
func TestChartNormalisesSlashes(t *testing.T) {
	c := loadChart(t)
	const drivers = `
drivers:
  - {name: nfs.csi.k8s.io, type: CSIPlugin, endpoint: %[1]s/plugins/csi-nfsplugin/csi.sock}
  - {name: smb.csi.k8s.io, type: CSIPlugin, endpoint: /run/csi/smb/csi.sock}
`
	for _, root := range []string{kubeletRoot, k3sKubeletDir} {
		clean := mustValues(t, "kubeletDir: "+root+"\nextraHostPaths: [/run/csi, /opt/dp]"+strings.ReplaceAll(drivers, "%[1]s", root))
		want, err := renderChart(c, clean)
		if err != nil {
			t.Fatal(err)
		}
		wantNotes := renderNotes(t, c, clean)
		for _, slashes := range []string{"/", "//"} {
			t.Run(root+slashes, func(t *testing.T) {
				values := mustValues(t, "kubeletDir: "+root+slashes+"\nextraHostPaths: [/run/csi"+slashes+", /opt/dp]"+strings.ReplaceAll(drivers, "%[1]s", root))
				got, err := renderChart(c, values)
				if err != nil {
					t.Fatal(err)
				}
				if got != want {
					t.Errorf("rendered with kubeletDir %q and extraHostPaths %v:\n%s\nwithout the trailing slashes:\n%s", root+slashes, values["extraHostPaths"], got, want)
				}
				if notes := renderNotes(t, c, values); notes != wantNotes {
					t.Errorf("NOTES.txt:\n%s\nwithout the trailing slashes:\n%s", notes, wantNotes)
				}
			})
		}
	}
}

// renderNotes renders the chart's NOTES.txt, what `helm install` prints.
func renderNotes(t testing.TB, c *chart.Chart, values map[string]any) string {
	t.Helper()
	opts := chartutil.ReleaseOptions{Name: releaseName, Namespace: releaseNamespace, Revision: 1, IsInstall: true}
	vals, err := chartutil.ToRenderValues(c, values, opts, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Engine{Strict: true}.Render(c, vals)
	if err != nil {
		t.Fatal(err)
	}
	notes, ok := files[filepath.Join(c.Name(), "templates", "NOTES.txt")]
	if !ok {
		t.Fatal("no NOTES.txt rendered")
	}
	return notes
}

// TestChartNotes checks what `helm install` prints: not to trust `helm install --wait`, to wait
// with `kubectl rollout status`, and to ask `multireg status` in the pod of a given node, with a
// command line multireg accepts (the HTTP endpoint when httpPort is not the default).
func TestChartNotes(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		name     string
		values   string
		endpoint string // --http-endpoint of `multireg status`; "" for none
	}{
		{"default values", "", ""},
		{"another port", "httpPort: 9900\nkubeletDir: /var/lib/k0s/kubelet/\n", "127.0.0.1:9900"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			notes := renderNotes(t, c, mustValues(t, tc.values+"drivers: []\n"))
			for _, want := range []string{
				"kubectl -n " + releaseNamespace + " rollout status ds/multireg",
				"--wait",
				"--field-selector spec.nodeName=",
				"names the driver",
			} {
				if !strings.Contains(notes, want) {
					t.Errorf("NOTES.txt does not say %q:\n%s", want, notes)
				}
			}
			if strings.Contains(notes, "//") {
				t.Errorf("NOTES.txt has a path with //:\n%s", notes)
			}
			// Every `multireg status` command line: multireg must accept its flags.
			cmds := regexp.MustCompile(`/multireg (status[^\n]*)`).FindAllStringSubmatch(notes, -1)
			if len(cmds) == 0 {
				t.Fatalf("NOTES.txt runs no `/multireg status`:\n%s", notes)
			}
			for _, cmd := range cmds {
				args := strings.Fields(cmd[1])
				if err := checkArgs(t, args); err != nil {
					t.Error(err)
				}
				if got, _ := flagValue(args, "http-endpoint"); got != tc.endpoint {
					t.Errorf("%q: --http-endpoint %q; want %q", cmd[0], got, tc.endpoint)
				}
			}
		})
	}
}

// TestChartNotesUnpublishedImage: what `helm install` prints warns when the pods would pull an
// image nobody publishes — the release workflow's repository with a development tag (a
// development chart's appVersion, …-dev), no digest — and says how to set image.repository
// and image.tag; it says nothing of the kind for a release's tag, a repository of one's own,
// or a digest.
func TestChartNotesUnpublishedImage(t *testing.T) {
	c := loadChart(t)
	repo := makeVar(t, "IMAGE_REPO")
	digest := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	for _, tc := range []struct {
		name, values, image string // image: the one the warning names; "" for no warning
	}{
		{"default values", "", map[bool]string{true: repo + ":" + c.Metadata.AppVersion}[strings.HasSuffix(c.Metadata.AppVersion, "-dev")]},
		{"a development tag", "image: {tag: v9.9.9-dev}", repo + ":v9.9.9-dev"},
		{"the release repository, named", "image: {repository: " + repo + ", tag: v9.9.9-dev}", repo + ":v9.9.9-dev"},
		{"a development build's tag", "image: {tag: v9.9.9-dev.0123abc}", repo + ":v9.9.9-dev.0123abc"},
		{"a release's tag", "image: {tag: v9.9.9}", ""},
		{"a repository of one's own", "image: {repository: registry.test/mr, tag: v9.9.9-dev}", ""},
		{"a digest", "image: {tag: v9.9.9-dev, digest: " + digest + "}", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			notes := renderNotes(t, c, mustValues(t, tc.values+"\ndrivers: []\n"))
			warns := strings.Contains(notes, "WARNING")
			switch {
			case tc.image == "" && warns:
				t.Errorf("NOTES.txt warns of the image, though it is %s:\n%s", tc.name, notes)
			case tc.image != "" && !warns:
				t.Errorf("NOTES.txt does not warn that %s is not published:\n%s", tc.image, notes)
			case tc.image != "":
				if !strings.HasPrefix(notes, "WARNING") {
					t.Errorf("NOTES.txt's warning is not the first thing it says:\n%s", notes)
				}
				for _, want := range []string{
					"the image " + tc.image + " is not published",
					"ImagePullBackOff",
					"make image-push IMAGE=",
					"--set image.repository=",
					"--set image.tag=$(make -s image-tag)",
					"helm upgrade " + releaseName + " charts/multireg -n " + releaseNamespace + " --reuse-values",
				} {
					if !strings.Contains(notes, want) {
						t.Errorf("NOTES.txt's warning does not say %q:\n%s", want, notes)
					}
				}
			}
		})
	}
}
