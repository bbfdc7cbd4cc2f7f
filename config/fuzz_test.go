package config

import (
	"bytes"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	yamlnode "go.yaml.in/yaml/v3"
)

// FuzzParse feeds arbitrary bytes to Parse. It must never panic, must be deterministic, and a
// configuration it accepts must satisfy every invariant the registrar relies on.
func FuzzParse(f *testing.F) {
	seeds, err := filepath.Glob(filepath.Join("testdata", "*.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range seeds {
		b, err := os.ReadFile(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		cfg, err := Parse(b)
		cfg2, err2 := Parse(b)
		if (err == nil) != (err2 == nil) || (err != nil && err.Error() != err2.Error()) || !reflect.DeepEqual(cfg, cfg2) {
			t.Fatalf("Parse is not deterministic: %v / %v", err, err2)
		}
		if err != nil {
			if cfg != nil {
				t.Fatalf("Parse returned a config and an error: %v", err)
			}
			for line := range strings.SplitSeq(err.Error(), "\n") {
				if strings.TrimSpace(line) == "" {
					t.Fatalf("empty line in errors: %q", err.Error())
				}
			}
			return
		}
		checkInvariants(t, cfg)
		checkOneDocument(t, b)
	})
}

// checkOneDocument checks, for a file that Parse accepted, what the YAML node tree says: one
// document that is not empty, no merge key anywhere, and a drivers key that holds a list.
func checkOneDocument(t *testing.T, b []byte) {
	t.Helper()
	dec := yamlnode.NewDecoder(bytes.NewReader(b))
	var docs []*yamlnode.Node
	for {
		n := new(yamlnode.Node)
		if err := dec.Decode(n); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("accepted a file the YAML parser refuses: %v", err)
		}
		if len(n.Content) > 0 && (n.Content[0].Tag != "!!null" || n.Content[0].Value != "" || n.Content[0].Anchor != "") {
			docs = append(docs, n)
		}
	}
	if len(docs) != 1 {
		t.Fatalf("accepted a file of %d documents that are not empty", len(docs))
	}
	var drivers *yamlnode.Node
	top := docs[0].Content[0]
	for i := 0; i+1 < len(top.Content); i += 2 {
		if top.Content[i].Value == "drivers" {
			drivers = top.Content[i+1]
		}
	}
	for drivers != nil && drivers.Kind == yamlnode.AliasNode {
		drivers = drivers.Alias
	}
	if drivers == nil || drivers.Kind != yamlnode.SequenceNode {
		t.Fatalf("accepted a file whose drivers key is not a list: %+v", drivers)
	}
	for stack := []*yamlnode.Node{top}; len(stack) > 0; {
		n := stack[len(stack)-1]
		stack = append(stack[:len(stack)-1], n.Content...)
		if n.Tag == "!!merge" {
			t.Fatalf("accepted a merge key at line %d", n.Line)
		}
	}
}

func checkInvariants(t *testing.T, cfg *RegistrarConfig) {
	t.Helper()
	if !filepath.IsAbs(cfg.RegistrationDir) || strings.ContainsRune(cfg.RegistrationDir, 0) {
		t.Fatalf("registrationDir %q", cfg.RegistrationDir)
	}
	names := map[string]bool{}
	sockets := map[string]bool{}
	for _, d := range cfg.Drivers {
		switch {
		case d.Name == "" || names[d.Name]:
			t.Fatalf("empty or duplicate name %q", d.Name)
		case !slices.Contains(Types, d.Type):
			t.Fatalf("driver %q: type %q", d.Name, d.Type)
		case sockets[d.SocketPath] || filepath.Dir(d.SocketPath) != cfg.RegistrationDir || len(d.SocketPath) > MaxSocketPathLen:
			t.Fatalf("driver %q: socket path %q", d.Name, d.SocketPath)
		case strings.HasPrefix(d.SocketName, ".") || strings.Contains(d.SocketName, "/"):
			t.Fatalf("driver %q: socket name %q", d.Name, d.SocketName)
		case !filepath.IsAbs(d.Endpoint) || len(shortestMatch(d.Endpoint)) > MaxSocketPathLen:
			t.Fatalf("driver %q: endpoint %q", d.Name, d.Endpoint)
		case !filepath.IsAbs(d.LocalEndpoint) || len(d.LocalEndpoint) > MaxSocketPathLen:
			t.Fatalf("driver %q: local endpoint %q", d.Name, d.LocalEndpoint)
		case len(d.SupportedVersions) == 0:
			t.Fatalf("driver %q: no versions", d.Name)
		case !kubeletCanDial(shortestMatch(d.Endpoint)) || !kubeletCanDial(d.SocketPath):
			t.Fatalf("driver %q: kubelet cannot dial %q or %q", d.Name, d.Endpoint, d.SocketPath)
		case strings.ContainsRune(d.Endpoint+d.LocalEndpoint+d.SocketPath, 0):
			t.Fatalf("driver %q: a NUL byte in a path: %q, %q, %q", d.Name, d.Endpoint, d.LocalEndpoint, d.SocketPath)
		case d.Backoff.InitialInterval < MinInterval || d.Backoff.MaxInterval < d.Backoff.InitialInterval ||
			!(d.Backoff.Multiplier >= 1) || math.IsInf(d.Backoff.Multiplier, 0) ||
			!(d.Backoff.RandomizationFactor >= 0 && d.Backoff.RandomizationFactor <= 1):
			t.Fatalf("driver %q: backoff %+v", d.Name, d.Backoff)
		case d.RegistrationTimeout < 0:
			t.Fatalf("driver %q: registration timeout %s", d.Name, d.RegistrationTimeout)
		case d.Type == DevicePlugin && (filepath.Dir(d.Endpoint) == KubeletDevicePluginDir || filepath.Dir(d.LocalEndpoint) == KubeletDevicePluginDir):
			t.Fatalf("driver %q: endpoint %q (local %q) in kubelet's device-plugin directory", d.Name, d.Endpoint, d.LocalEndpoint)
		}
		names[d.Name] = true
		sockets[d.SocketPath] = true
	}
}

// shortestMatch returns the shortest path an endpoint pattern matches, with each '?' as a
// byte kubelet can dial: '*' may match nothing and '?' matches one byte, which is judged when
// the socket appears (KubeletCanDial), so what the configuration itself must hold to is the
// rest of the path, at that length.
func shortestMatch(endpoint string) string {
	if !IsPattern(endpoint) {
		return endpoint
	}
	dir, base := filepath.Split(endpoint)
	return dir + strings.NewReplacer("*", "", "?", "x").Replace(base)
}
