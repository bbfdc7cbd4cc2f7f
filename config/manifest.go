package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

// MaxManifestSize is the largest input `multireg validate` reads when it may be a stream of
// manifests (a rendered chart), in bytes. Each drivers file in it stays bounded by MaxFileSize.
const MaxManifestSize = 16 << 20

// apiGroup is the group of APIVersion: a drivers file's apiVersion is apiGroup/<version>.
const apiGroup = "multireg.dev"

// Found is a drivers file found in an input: the input itself, or a ConfigMap's data key.
type Found struct {
	// Where names the ConfigMap and its key, e.g. `ConfigMap kube-system/multireg (document 3
	// at line 40) data[config.yaml]`; empty when the input is the drivers file itself.
	// Documents are counted as they hold something: helm template's comment-only ones are not.
	Where   string
	Content []byte
}

// Extract returns the drivers files an input holds: the input itself when it is a drivers
// file, or, when it is Kubernetes manifests (a ConfigMap, a List of them, `kubectl get -o
// yaml` or `helm template` output), the drivers key of every multireg ConfigMap in it.
//
// A multireg ConfigMap is one that holds a drivers file: a data key whose content is a
// mapping with apiVersion multireg.dev/… or kind RegistrarConfig (or, when it is not YAML at
// all, names either). Labels say nothing: other objects of a release carry the same ones (the
// chart's dashboard ConfigMap does). Its drivers key is key when given, otherwise every key
// that holds a drivers file. An input that is neither a drivers file nor manifests is returned
// whole, for Parse to say what is wrong with it.
func Extract(b []byte, key string) ([]Found, error) {
	docs, err := documents(b)
	if err != nil || !slices.ContainsFunc(docs, isManifest) {
		return []Found{{Content: b}}, nil
	}
	var found []Found
	var errs []error
	for i, d := range docs {
		objs := []manifest{d}
		if d.Kind == "List" {
			objs = d.Items
		}
		for j, o := range objs {
			where := fmt.Sprintf("document %d at line %d", i+1, d.line)
			if d.Kind == "List" {
				where = fmt.Sprintf("document %d at line %d, items[%d]", i+1, d.line, j)
			}
			if o.Kind != "ConfigMap" || !o.holdsDriversFile() {
				continue
			}
			name := o.Metadata.Name
			if o.Metadata.Namespace != "" {
				name = o.Metadata.Namespace + "/" + name
			}
			where = fmt.Sprintf("ConfigMap %s (%s)", name, where)
			keys, err := o.driverKeys(key)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", where, err))
				continue
			}
			for _, k := range keys {
				found = append(found, Found{Where: fmt.Sprintf("%s data[%s]", where, k), Content: []byte(o.Data[k])})
			}
		}
	}
	if len(found) == 0 && len(errs) == 0 {
		return nil, fmt.Errorf("no multireg ConfigMap among the %d documents: none has a data key holding a drivers file (apiVersion: %s, kind: %s)", len(docs), APIVersion, Kind)
	}
	return found, errors.Join(errs...)
}

// manifest is what Extract reads of a Kubernetes object.
type manifest struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name      string `yaml:"name"`
		Namespace string `yaml:"namespace"`
	} `yaml:"metadata"`
	Data  map[string]string `yaml:"data"`
	Items []manifest        `yaml:"items"`
	line  int               // where the document starts in the stream
}

// isManifest reports whether a document is a Kubernetes object Extract looks into.
func isManifest(m manifest) bool {
	return m.APIVersion == "v1" && (m.Kind == "ConfigMap" || m.Kind == "List")
}

// holdsDriversFile reports whether a data key of the ConfigMap holds a drivers file.
func (m manifest) holdsDriversFile() bool {
	for _, v := range m.Data {
		if isDriversFile(v) {
			return true
		}
	}
	return false
}

// isDriversFile reports whether a data value is a drivers file, valid or not: its first
// document is a mapping whose apiVersion is multireg.dev/… or whose kind is RegistrarConfig
// (either is enough, so that a file with the other one wrong is still checked; the keys and
// values in any case, so that one written in the wrong case is too). A value that is not YAML
// is one when it names either, so that a drivers file broken beyond parsing is checked too.
func isDriversFile(v string) bool {
	var n yaml.Node
	if err := yaml.Unmarshal([]byte(v), &n); err != nil {
		return strings.Contains(v, Kind) || strings.Contains(v, apiGroup+"/")
	}
	if len(n.Content) == 0 || n.Content[0].Kind != yaml.MappingNode {
		return false
	}
	top := n.Content[0].Content
	for i := 0; i+1 < len(top); i += 2 {
		k, val := top[i], top[i+1]
		if k.Kind != yaml.ScalarNode || val.Kind != yaml.ScalarNode {
			continue
		}
		switch {
		case strings.EqualFold(k.Value, "apiVersion") && strings.HasPrefix(strings.ToLower(val.Value), apiGroup+"/"),
			strings.EqualFold(k.Value, "kind") && strings.EqualFold(val.Value, Kind):
			return true
		}
	}
	return false
}

// driverKeys are the data keys of a multireg ConfigMap to validate, sorted: key when given,
// else those holding a drivers file.
func (m manifest) driverKeys(key string) ([]string, error) {
	if key != "" {
		if _, ok := m.Data[key]; !ok {
			return nil, fmt.Errorf("data[%s]: no such key (keys: %s)", key, strings.Join(m.keys(), ", "))
		}
		return []string{key}, nil
	}
	var keys []string
	for _, k := range m.keys() {
		if isDriversFile(m.Data[k]) {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

func (m manifest) keys() []string {
	keys := make([]string, 0, len(m.Data))
	for k := range m.Data {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// documents decodes every document (counting those that are not empty) of a YAML (or JSON) stream into what Extract reads of
// it; empty documents (comments only, as helm template writes between objects) are skipped.
func documents(b []byte) ([]manifest, error) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	var docs []manifest
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(n.Content) == 0 || isNull(n.Content[0]) {
			continue
		}
		m := manifest{line: n.Content[0].Line}
		if n.Content[0].Kind == yaml.MappingNode {
			// A field of another type than Extract expects leaves it unset, and the rest read.
			if err := n.Decode(&m); err != nil && !errors.As(err, new(*yaml.TypeError)) {
				return nil, err
			}
		}
		docs = append(docs, m)
	}
}
