package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestValidateHintsAtChartValues: the chart's values given to validate as a drivers file (the
// README's my-drivers.yaml, the chart's own values.yaml) get, after their problems, one line
// saying to render the chart first; a drivers file with a mistake does not.
func TestValidateHintsAtChartValues(t *testing.T) {
	root := filepath.Join("..", "..")
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)```yaml\n(# my-drivers.yaml\n.*?)```").FindSubmatch(readme)
	if m == nil {
		t.Fatal("README.md has no my-drivers.yaml block")
	}
	chartValues, err := os.ReadFile(filepath.Join(root, "charts", "multireg", "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	const hint = "hint: this looks like the chart's values file, not a drivers file: render the chart first: helm template multireg charts/multireg -f "
	dir := t.TempDir()
	for _, tt := range []struct {
		name, content string
		hint          bool
	}{
		{"my-drivers.yaml", string(m[1]), true},
		{"values.yaml", string(chartValues), true},
		{"image-only.yaml", "image: {repository: registry.example.com/you/multireg}\n", true},
		{"kubelet-dir.yaml", "kubeletDir: /var/lib/k0s/kubelet\n", true},
		{"no-kind.yaml", "apiVersion: multireg.dev/v1alpha1\ndrivers: []\n", false},
		{"no-apiversion.yaml", "kind: RegistrarConfig\ndrivers: []\n", false},
		{"unknown.yaml", "registrationDir: /var/lib/kubelet/plugins_registry\n", false},
		{"list.yaml", "- drivers: []\n", false},
	} {
		file := filepath.Join(dir, tt.name)
		if err := os.WriteFile(file, []byte(tt.content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, _, err := runArgs("validate", "-f", file)
		if err == nil || exitCode(err) != 1 {
			t.Fatalf("%s: %v (exit %d), want exit 1", tt.name, err, exitCode(err))
		}
		lines := strings.Split(err.Error(), "\n")
		last := lines[len(lines)-1]
		wantHint := file + ": " + hint + file + " --kube-version 1.33 | multireg validate -f -"
		if got := last == wantHint; got != tt.hint {
			t.Errorf("%s: last line %q; want the hint: %v", tt.name, last, tt.hint)
		}
		if tt.hint && !slices.ContainsFunc(lines[:len(lines)-1], func(l string) bool { return strings.Contains(l, "apiVersion") }) {
			t.Errorf("%s: %v; want the problems before the hint", tt.name, err)
		}
	}
	// Standard input: the hint names a values file to give helm.
	_, _, err = runStdin(string(m[1]), "validate", "-f", "-")
	if want := "<stdin>: " + hint + "my-values.yaml --kube-version 1.33 | multireg validate -f -"; err == nil || !strings.HasSuffix(err.Error(), "\n"+want) {
		t.Errorf("my-drivers.yaml on standard input: %v; want the last line %q", err, want)
	}
}

// TestChartValuesKeys: chartValues are the keys of the chart's values.yaml but drivers and
// defaults (which a drivers file has too), and Helm's global.
func TestChartValuesKeys(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "charts", "multireg", "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values yaml.Node
	if err := yaml.Unmarshal(b, &values); err != nil {
		t.Fatal(err)
	}
	want := []string{"global"}
	top := values.Content[0].Content
	for i := 0; i < len(top); i += 2 {
		if k := top[i].Value; k != "drivers" && k != "defaults" {
			want = append(want, k)
		}
	}
	got := slices.Clone(chartValues)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("chartValues %q; values.yaml's keys but drivers and defaults, and global: %q", got, want)
	}
}
