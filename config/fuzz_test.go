package config

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
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
	})
}

func checkInvariants(t *testing.T, cfg *RegistrarConfig) {
	t.Helper()
	if !filepath.IsAbs(cfg.RegistrationDir) {
		t.Fatalf("registrationDir %q is relative", cfg.RegistrationDir)
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
		case !filepath.IsAbs(d.Endpoint) || len(d.Endpoint) > MaxSocketPathLen:
			t.Fatalf("driver %q: endpoint %q", d.Name, d.Endpoint)
		case !filepath.IsAbs(d.LocalEndpoint) || len(d.LocalEndpoint) > MaxSocketPathLen:
			t.Fatalf("driver %q: local endpoint %q", d.Name, d.LocalEndpoint)
		case len(d.SupportedVersions) == 0:
			t.Fatalf("driver %q: no versions", d.Name)
		case d.Backoff.InitialInterval <= 0 || d.Backoff.MaxInterval < d.Backoff.InitialInterval ||
			d.Backoff.Multiplier < 1 || d.Backoff.RandomizationFactor < 0 || d.Backoff.RandomizationFactor > 1:
			t.Fatalf("driver %q: backoff %+v", d.Name, d.Backoff)
		case d.RegistrationTimeout < 0:
			t.Fatalf("driver %q: registration timeout %s", d.Name, d.RegistrationTimeout)
		}
		names[d.Name] = true
		sockets[d.SocketPath] = true
	}
}
