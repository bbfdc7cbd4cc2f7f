package config

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestExtract(t *testing.T) {
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tt := range []struct {
		give      string
		key       string
		wantWhere []string // "" is the input itself
		wantErr   string
	}{
		{give: "valid-full.yaml", wantWhere: []string{""}},
		// A drivers file with a second document stays a drivers file: Parse refuses it.
		{give: "invalid-second-document.yaml", wantWhere: []string{""}},
		{give: "invalid-syntax.yaml", wantWhere: []string{""}},
		{give: "manifests/configmap.yaml", wantWhere: []string{"ConfigMap kube-system/multireg (document 1 at line 2) data[config.yaml]"}},
		{give: "manifests/rendered.yaml", wantWhere: []string{
			"ConfigMap kube-system/multireg (document 2 at line 11) data[config.yaml]",
			"ConfigMap gpu/gpu-multireg (document 4 at line 35) data[drivers.yaml]",
		}},
		{give: "manifests/list.yaml", wantWhere: []string{"ConfigMap kube-system/multireg (document 1 at line 2, items[0]) data[config.yaml]"}},
		// The dashboard's ConfigMap and another one carry the chart's labels: neither holds a
		// drivers file, and neither is checked.
		{give: "manifests/dashboard.yaml", wantWhere: []string{"ConfigMap kube-system/multireg (document 1 at line 6) data[config.yaml]"}},
		{give: "manifests/list.yaml", key: "notes.txt", wantWhere: []string{"ConfigMap kube-system/multireg (document 1 at line 2, items[0]) data[notes.txt]"}},
		{give: "manifests/list.yaml", key: "drivers.yaml", wantErr: "ConfigMap kube-system/multireg (document 1 at line 2, items[0]): data[drivers.yaml]: no such key (keys: config.yaml, notes.txt)"},
	} {
		t.Run(tt.give+tt.key, func(t *testing.T) {
			found, err := Extract(read(tt.give), tt.key)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var where []string
			for _, f := range found {
				where = append(where, f.Where)
			}
			if !slices.Equal(where, tt.wantWhere) {
				t.Errorf("found %q, want %q", where, tt.wantWhere)
			}
		})
	}
}

// TestExtractJSON: kubectl get configmap -o json, as well as YAML.
func TestExtractJSON(t *testing.T) {
	in := `{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "multireg", "namespace": "kube-system"},
  "data": {"config.yaml": "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers: []\n"}}`
	found, err := Extract([]byte(in), "")
	if err != nil || len(found) != 1 || found[0].Where != "ConfigMap kube-system/multireg (document 1 at line 1) data[config.yaml]" {
		t.Fatalf("%+v, %v", found, err)
	}
	if _, err := Parse(found[0].Content); err != nil {
		t.Error(err)
	}
}

func TestExtractRefusesManifestsWithoutMultireg(t *testing.T) {
	for _, in := range []string{
		"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other}\ndata: {a: b}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
		// Labelled as the chart labels its objects, holding no drivers file: not multireg's.
		"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: m, labels: {app.kubernetes.io/name: multireg}}\ndata: {a.yaml: x, b.json: '{\"title\": \"multireg\"}'}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
	} {
		_, err := Extract([]byte(in), "")
		if want := "no multireg ConfigMap among the 2 documents: none has a data key holding a drivers file (apiVersion: multireg.dev/v1alpha1, kind: RegistrarConfig)"; err == nil || err.Error() != want {
			t.Errorf("err %v, want %q", err, want)
		}
	}
}

// TestIsDriversFile: a data value is a drivers file by what it holds, valid or not.
func TestIsDriversFile(t *testing.T) {
	for _, tt := range []struct {
		give string
		want bool
	}{
		{"apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers: []\n", true},
		{"apiVersion: multireg.dev/v1alpha1\ndrivers: []\n", true},                           // kind missing: Parse says so
		{"apiVersion: multireg.dev/v1beta9\nkind: RegistrarConfg\n", true},                   // both wrong but the group
		{"apiVersion: example.com/v1\nkind: RegistrarConfig\n", true},                        // the wrong group
		{"ApiVersion: Multireg.dev/v1alpha1\nKind: registrarconfig\n", true},                 // the wrong case
		{"{\"apiVersion\": \"multireg.dev/v1alpha1\", \"kind\": \"RegistrarConfig\"}", true}, // JSON
		{"apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers: [\n", true},     // not YAML: named
		{"kind: RegistrarConfig\n\tdrivers: []\n", true},                                     // not YAML (a tab): named
		{"drivers:\n  - name: nfs.csi.k8s.io\n", false},                                      // a values file
		{"apiVersion: v1\nkind: Config\n", false},
		{"{\"title\": \"multireg\", \"uid\": \"multireg\", \"panels\": []}", false}, // a dashboard
		{"not: [a drivers file", false},
		{"- apiVersion: multireg.dev/v1alpha1\n", false},
		{"multireg.dev/v1alpha1", false},
		{"", false},
	} {
		if got := isDriversFile(tt.give); got != tt.want {
			t.Errorf("isDriversFile(%q) = %v, want %v", tt.give, got, tt.want)
		}
	}
}
