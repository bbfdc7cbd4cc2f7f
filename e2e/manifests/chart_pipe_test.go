package manifests

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"sigs.k8s.io/yaml"
)

// helmTemplate is `helm template` without a cluster: with kubeVersion as --kube-version, or,
// for "", Helm's own default, which for a Helm built without its release's linker flags (go
// install, and this test's Helm library) is Kubernetes 1.20. As the helm command does (its
// install action, client only), it first checks the chart's kubeVersion against it with
// chartutil.IsCompatibleRange, then renders every template, the test pod among them.
func helmTemplate(c *chart.Chart, values map[string]any, kubeVersion string) (string, error) {
	caps := chartutil.DefaultCapabilities.Copy()
	if kubeVersion != "" {
		kv, err := chartutil.ParseKubeVersion(kubeVersion)
		if err != nil {
			return "", fmt.Errorf("--kube-version %s: %w", kubeVersion, err)
		}
		caps.KubeVersion = *kv
	}
	if !chartutil.IsCompatibleRange(c.Metadata.KubeVersion, caps.KubeVersion.String()) {
		return "", fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s", c.Metadata.KubeVersion, caps.KubeVersion.String())
	}
	files, err := renderFilesFor(c, values, caps)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(files)) {
		if strings.HasSuffix(name, ".yaml") {
			fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", name, files[name])
		}
	}
	return b.String(), nil
}

// validateStream pipes manifests into `multireg validate -f -` and returns its standard
// output, or its error with what it printed.
func validateStream(t testing.TB, manifests string) (string, error) {
	t.Helper()
	cmd := exec.Command(binary(t), "validate", "-f", "-")
	cmd.Stdin = strings.NewReader(manifests)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return stdout.String(), fmt.Errorf("multireg validate -f - exit %d:\n%s", exit.ExitCode(), stderr.String())
	case err != nil:
		t.Fatal(err)
	}
	return stdout.String(), nil
}

// TestChartStreamValidates pipes the whole chart, as helm template prints it, into multireg
// validate -f -, with every optional object on: the dashboard's ConfigMap, the monitors and
// the rules carry the chart's labels, and only the drivers file's ConfigMap is checked.
func TestChartStreamValidates(t *testing.T) {
	c := loadChart(t)
	values := readValues(t, "values-drivers.yaml")
	values["metrics"] = map[string]any{
		"podMonitor":     map[string]any{"enabled": true},
		"prometheusRule": map[string]any{"enabled": true, "runbookBaseURL": "https://forge.example/multireg/blob/v0.1.0/docs/runbook.md"},
		"dashboard":      map[string]any{"enabled": true},
	}
	out, err := helmTemplate(c, values, "1.33")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "kind: ConfigMap") || !strings.Contains(out, "multireg.json: |-") || !strings.Contains(out, "helm.sh/hook: test") {
		t.Fatalf("the render lacks the dashboard's ConfigMap or the test pod:\n%s", out)
	}
	stdout, err := validateStream(t, out)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(lines) != 1 || !regexp.MustCompile(`^<stdin>: ConfigMap kube-system/multireg \(document \d+ at line \d+\) data\[config\.yaml\]: valid: 4 drivers `).MatchString(lines[0]) {
		t.Errorf("multireg validate printed %q; want one line, for the drivers file's ConfigMap", stdout)
	}
}

// docsWithHelmPipes are the files whose `helm template … | multireg validate` lines a person
// copies.
var docsWithHelmPipes = []string{
	"README.md", "docs/*.md", "charts/multireg/README.md", "charts/multireg/values.yaml",
	"charts/multireg/templates/NOTES.txt", "cmd/multireg/validate.go",
}

// helmPipes returns every `helm template … | multireg validate` of the docs, a continued line
// ("\" at its end) joined, each with where it is.
func helmPipes(t *testing.T) (pipes, where []string) {
	t.Helper()
	root := repoRoot(t)
	for _, pattern := range docsWithHelmPipes {
		files, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil || len(files) == 0 {
			t.Fatalf("%s: no file (%v)", pattern, err)
		}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			text := regexp.MustCompile(`\\\n\s*`).ReplaceAllString(string(b), "")
			for _, m := range regexp.MustCompile("helm template[^|\n`]*\\|\\s*multireg validate").FindAllString(text, -1) {
				rel, _ := filepath.Rel(root, f)
				pipes, where = append(pipes, m), append(where, rel)
			}
		}
	}
	if len(pipes) < 5 {
		t.Fatalf("%d helm template pipes into multireg validate in %v; the docs have more", len(pipes), docsWithHelmPipes)
	}
	return pipes, where
}

// TestDocsHelmPipesOnAnyHelm: every `helm template … | multireg validate` of the docs passes
// --kube-version, or it fails on every Helm whose default Kubernetes is below the chart's
// kubeVersion (3.17 and older: 1.32 at most; one built with go install: 1.20). The test
// renders the chart as helm template does without that flag (this Helm library's default is
// go install's) and with a Helm 3.17's default, and sees the failure; then with each line's
// own --kube-version, piped into multireg validate.
func TestDocsHelmPipesOnAnyHelm(t *testing.T) {
	c := loadChart(t)
	values := readValues(t, "values-drivers.yaml")
	for _, old := range []string{"", "1.32"} {
		_, err := helmTemplate(c, values, old)
		if want := "chart requires kubeVersion: " + c.Metadata.KubeVersion + " which is incompatible with Kubernetes v1."; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("helm template with the Kubernetes version %q: %v; want %q", old, err, want)
		}
	}
	pipes, where := helmPipes(t)
	versions := map[string]bool{}
	for i, p := range pipes {
		m := regexp.MustCompile(`--kube-version[= ](\S+)`).FindStringSubmatch(p)
		if m == nil {
			t.Errorf("%s: %q: no --kube-version: fails on Helm 3.17 and older, and on one built with go install", where[i], p)
			continue
		}
		versions[m[1]] = true
	}
	if len(versions) != 1 {
		t.Errorf("the docs pass --kube-version %v; want one version everywhere", versions)
	}
	for v := range versions {
		out, err := helmTemplate(c, values, v)
		if err != nil {
			t.Errorf("helm template --kube-version %s: %v", v, err)
			continue
		}
		if _, err := validateStream(t, out); err != nil {
			t.Errorf("helm template --kube-version %s | multireg validate -f -: %v", v, err)
		}
	}
}

// TestChartRendersAlikeOnEveryKubeVersion: the chart renders the same for every Kubernetes
// version it supports, so that the docs' one --kube-version is right for any cluster.
func TestChartRendersAlikeOnEveryKubeVersion(t *testing.T) {
	c := loadChart(t)
	var values map[string]any
	if err := yaml.Unmarshal([]byte("drivers: [{name: nfs.csi.k8s.io, type: CSIPlugin, endpoint: /var/lib/kubelet/plugins/nfs/csi.sock}]\nmetrics: {dashboard: {enabled: true}}\n"), &values); err != nil {
		t.Fatal(err)
	}
	first, err := helmTemplate(c, values, "1.33")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"1.34", "1.35", "1.36", "1.37.2", "1.38"} {
		out, err := helmTemplate(c, values, v)
		if err != nil || out != first {
			t.Errorf("helm template --kube-version %s: %v; renders otherwise than with 1.33", v, err)
		}
	}
}
