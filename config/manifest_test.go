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
	in := "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other}\ndata: {a: b}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"
	_, err := Extract([]byte(in), "")
	if want := "no multireg ConfigMap among the 2 documents"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("err %v, want %q", err, want)
	}
	// Labelled, with two keys and no RegistrarConfig in either: which one is meant?
	in = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: m, labels: {app.kubernetes.io/name: multireg}}\ndata: {a.yaml: x, b.yaml: y}\n"
	_, err = Extract([]byte(in), "")
	if want := "which key is the drivers file? (keys: a.yaml, b.yaml; give --key)"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("err %v, want %q", err, want)
	}
}
