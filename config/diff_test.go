package config

import (
	"reflect"
	"strings"
	"testing"
)

const diffBase = `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
drivers:
  - name: a.csi.k8s.io
    type: CSIPlugin
    endpoint: /run/a/csi.sock
  - name: b.csi.k8s.io
    type: CSIPlugin
    endpoint: /run/b/csi.sock
    backoff: {initialInterval: 3s}
  - name: vendor.example/gpu
    type: DevicePlugin
    endpoint: /run/gpu/dp.sock
`

func mustParse(t *testing.T, s string) *RegistrarConfig {
	t.Helper()
	cfg, err := Parse([]byte(s))
	if err != nil {
		t.Fatalf("Parse: %v\n%s", err, s)
	}
	return cfg
}

func names(ds []Driver) []string {
	var n []string
	for _, d := range ds {
		n = append(n, d.Name)
	}
	return n
}

func TestDiff(t *testing.T) {
	tests := []struct {
		name                    string
		old, new                string // "" means a nil configuration
		added, removed, changed []string
		updated                 []string
	}{
		{name: "identical", old: diffBase, new: diffBase},
		{
			name: "comments and key order only",
			old:  diffBase,
			new: `# edited by hand
kind: RegistrarConfig
apiVersion: multireg.dev/v1alpha1
drivers:
  - type: CSIPlugin   # the NFS one
    endpoint: /run/a/csi.sock
    name: a.csi.k8s.io
  - name: b.csi.k8s.io
    backoff:
      initialInterval: 3s
    endpoint: /run/b/csi.sock
    type: CSIPlugin
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: /run/gpu/dp.sock}
`,
		},
		{
			name: "explicit defaults equal the built-in ones",
			old:  diffBase,
			new: diffBase + `registrationDir: /var/lib/kubelet/plugins_registry
defaults:
  backoff: {initialInterval: 500ms, maxInterval: 2m, multiplier: 2, randomizationFactor: 0.2}
  registrationTimeout: 2m
  waitForEndpoint: true
`,
		},
		{name: "from nothing", new: diffBase, added: []string{"a.csi.k8s.io", "b.csi.k8s.io", "vendor.example/gpu"}},
		{name: "to nothing", old: diffBase, removed: []string{"a.csi.k8s.io", "b.csi.k8s.io", "vendor.example/gpu"}},
		{
			name:    "one endpoint",
			old:     diffBase,
			new:     replace(diffBase, "/run/b/csi.sock", "/run/b2/csi.sock"),
			changed: []string{"b.csi.k8s.io"},
		},
		{
			name:    "one versions list",
			old:     diffBase,
			new:     replace(diffBase, "endpoint: /run/a/csi.sock", "endpoint: /run/a/csi.sock\n    supportedVersions: [\"1.2.0\"]"),
			changed: []string{"a.csi.k8s.io"},
		},
		{
			name:    "add and remove",
			old:     diffBase,
			new:     replace(diffBase, "a.csi.k8s.io", "c.csi.k8s.io"),
			added:   []string{"c.csi.k8s.io"},
			removed: []string{"a.csi.k8s.io"},
		},
		{
			name:    "registrationDir changes every driver",
			old:     diffBase,
			new:     diffBase + "registrationDir: /var/lib/k0s/kubelet/plugins_registry\n",
			changed: []string{"a.csi.k8s.io", "b.csi.k8s.io", "vendor.example/gpu"},
		},
		{
			name:    "a default backoff updates every driver that inherits it",
			old:     diffBase,
			new:     diffBase + "defaults: {backoff: {initialInterval: 3s}}\n",
			updated: []string{"a.csi.k8s.io", "vendor.example/gpu"},
		},
		{
			name:    "required changes no registration",
			old:     diffBase,
			new:     replace(diffBase, "endpoint: /run/a/csi.sock", "endpoint: /run/a/csi.sock\n    required: true"),
			updated: []string{"a.csi.k8s.io"},
		},
		{
			name:    "required in defaults with another change",
			old:     diffBase,
			new:     replace(diffBase, "/run/b/csi.sock", "/run/b2/csi.sock") + "defaults: {required: true}\n",
			changed: []string{"b.csi.k8s.io"},
			updated: []string{"a.csi.k8s.io", "vendor.example/gpu"},
		},
		{
			name:    "a default timeout updates every driver",
			old:     diffBase,
			new:     diffBase + "defaults: {registrationTimeout: 30s}\n",
			updated: []string{"a.csi.k8s.io", "b.csi.k8s.io", "vendor.example/gpu"},
		},
		{
			name: "one driver's loop policy only",
			old:  diffBase,
			new: replace(diffBase, "backoff: {initialInterval: 3s}",
				"backoff: {initialInterval: 1s, maxInterval: 10s, multiplier: 3, randomizationFactor: 0.5}\n    registrationTimeout: 10s\n    waitForEndpoint: false\n    required: true"),
			updated: []string{"b.csi.k8s.io"},
		},
		{
			name:    "a default waitForEndpoint updates every driver",
			old:     diffBase,
			new:     diffBase + "defaults: {waitForEndpoint: false}\n",
			updated: []string{"a.csi.k8s.io", "b.csi.k8s.io", "vendor.example/gpu"},
		},
		{
			name:    "loop policy with a versions list changes the driver",
			old:     diffBase,
			new:     replace(diffBase, "backoff: {initialInterval: 3s}", "backoff: {initialInterval: 1s}\n    supportedVersions: [\"1.2.0\"]"),
			changed: []string{"b.csi.k8s.io"},
		},
		{
			// Where this process reaches the endpoint: kubelet sees nothing of it.
			name:    "one localEndpoint",
			old:     diffBase,
			new:     replace(diffBase, "endpoint: /run/a/csi.sock", "endpoint: /run/a/csi.sock\n    localEndpoint: /host/run/a/csi.sock"),
			updated: []string{"a.csi.k8s.io"},
		},
		{
			name:    "one socketName",
			old:     diffBase,
			new:     replace(diffBase, "endpoint: /run/a/csi.sock", "endpoint: /run/a/csi.sock\n    socketName: a.sock"),
			changed: []string{"a.csi.k8s.io"},
		},
		{
			name:    "an endpoint made a pattern",
			old:     diffBase,
			new:     replace(diffBase, "/run/gpu/dp.sock", "/run/gpu/dp.*"),
			changed: []string{"vendor.example/gpu"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var old, new *RegistrarConfig
			if tt.old != "" {
				old = mustParse(t, tt.old)
			}
			if tt.new != "" {
				new = mustParse(t, tt.new)
			}
			p := Diff(old, new)
			if got := names(p.Added); !reflect.DeepEqual(got, tt.added) {
				t.Errorf("Added = %q, want %q", got, tt.added)
			}
			if got := names(p.Removed); !reflect.DeepEqual(got, tt.removed) {
				t.Errorf("Removed = %q, want %q", got, tt.removed)
			}
			if got := names(p.Changed); !reflect.DeepEqual(got, tt.changed) {
				t.Errorf("Changed = %q, want %q", got, tt.changed)
			}
			if got := names(p.Updated); !reflect.DeepEqual(got, tt.updated) {
				t.Errorf("Updated = %q, want %q", got, tt.updated)
			}
			if empty := len(tt.added)+len(tt.removed)+len(tt.changed)+len(tt.updated) == 0; p.Empty() != empty {
				t.Errorf("Empty() = %v, want %v", p.Empty(), empty)
			}
		})
	}
}

// TestDiffCarriesSpecs checks that Removed holds the old spec (its socket must be removed) and
// Changed the new one (it must be started).
func TestDiffCarriesSpecs(t *testing.T) {
	old := mustParse(t, diffBase)
	new := mustParse(t, replace(replace(diffBase, "/run/b/csi.sock", "/run/b2/csi.sock"), "vendor.example/gpu", "vendor.example/fpga"))
	p := Diff(old, new)
	if len(p.Changed) != 1 || p.Changed[0].Endpoint != "/run/b2/csi.sock" {
		t.Errorf("Changed = %+v, want b with the new endpoint", p.Changed)
	}
	if len(p.Removed) != 1 || p.Removed[0].SocketPath != "/var/lib/kubelet/plugins_registry/vendor.example_gpu-reg.sock" {
		t.Errorf("Removed = %+v, want the gpu driver with its old socket path", p.Removed)
	}
}

func replace(s, old, new string) string { return strings.ReplaceAll(s, old, new) }

// groups are Driver's groups (config.go), each with what a change of one of its fields is.
var groups = map[string]Change{
	"Registration": ChangeRegistration,
	"Local":        ChangeLocal,
	"Policy":       ChangePolicy,
	"Display":      ChangeDisplay,
}

// TestEveryDriverFieldIsClassified: Driver holds its groups and nothing else, and a Driver
// that differs from another in one field differs in that field's group only, and is never
// Equal to it. Diff, the hand-over's RegistersAs and the loop read a field's meaning from its
// group, so a field outside them would mean nothing to any of them.
func TestEveryDriverFieldIsClassified(t *testing.T) {
	typ := reflect.TypeFor[Driver]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		bit, ok := groups[f.Name]
		if !ok || !f.Anonymous {
			t.Errorf("config.Driver.%s is in none of Driver's groups: move it into the one that says what a change of it does (config.go) — "+
				"Registration if kubelet sees it (a change registers the driver anew), Local if it is where this process reaches what kubelet reaches by its own path, "+
				"Policy if it paces the loop or decides readiness, Display if status only shows it", f.Name)
			continue
		}
		for j := range f.Type.NumField() {
			g := f.Type.Field(j)
			var a, b Driver
			setNonZero(t, reflect.ValueOf(&b).Elem().Field(i).Field(j), f.Name+"."+g.Name)
			if got := a.Changes(b); got != bit {
				t.Errorf("Driver.%s differs: Changes = %b, want %b (%s)", g.Name, got, bit, f.Name)
			}
			if a.Equal(b) {
				t.Errorf("Driver.%s differs: Equal = true", g.Name)
			}
			if a.Registration.Equal(b.Registration) == (bit == ChangeRegistration) {
				t.Errorf("Driver.%s differs: Registration.Equal = %v", g.Name, a.Registration.Equal(b.Registration))
			}
		}
	}
	if len(groups) != typ.NumField() {
		t.Errorf("Driver has %d fields, and %d groups are known here", typ.NumField(), len(groups))
	}
}

// setNonZero sets v, a field of a zero Driver, to a value other than its zero value.
func setNonZero(t *testing.T, v reflect.Value, name string) {
	t.Helper()
	switch v.Kind() {
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int64:
		v.SetInt(1)
	case reflect.Float64:
		v.SetFloat(1.5)
	case reflect.Slice:
		e := reflect.New(v.Type().Elem()).Elem()
		setNonZero(t, e, name)
		v.Set(reflect.Append(reflect.MakeSlice(v.Type(), 0, 1), e))
	case reflect.Map:
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		setNonZero(t, k, name)
		setNonZero(t, e, name)
		m := reflect.MakeMap(v.Type())
		m.SetMapIndex(k, e)
		v.Set(m)
	case reflect.Struct:
		setNonZero(t, v.Field(0), name)
	default:
		t.Fatalf("Driver.%s is a %s, which setNonZero cannot set yet: add a case for its kind there", name, v.Kind())
	}
}
