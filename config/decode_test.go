package config

import (
	"reflect"
	"testing"
	"time"
)

// TestDecodeReportsWhereTheValueIsUsed checks two things the node walk owes the paths it
// hands down: a value that fails to decode is not checked a second time (here against
// initialInterval), and a bad value reached through an alias is reported where the alias
// is used, not where the anchor is written.
func TestDecodeReportsWhereTheValueIsUsed(t *testing.T) {
	tests := []struct{ give, want string }{
		{"drivers:\n  - {name: a.csi.k8s.io, type: CSIPlugin, endpoint: /run/a.sock, backoff: {initialInterval: 7m, maxInterval: 1}}", `drivers[0].backoff.maxInterval: 1: must be a duration such as "500ms" or "2m"`},
		{"drivers:\n  - {name: a.csi.k8s.io, type: CSIPlugin, endpoint: /run/a.sock, supportedVersions: &v [\"1.0.0\"]}\n  - {name: *v, type: CSIPlugin, endpoint: /run/b.sock}",
			`drivers[1].name: ["1.0.0"]: must be a string`},
	}
	for _, tt := range tests {
		_, err := Parse([]byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\n" + tt.give + "\n"))
		if err == nil || err.Error() != tt.want {
			t.Errorf("Parse(%q):\n got: %v\nwant: %s", tt.give, err, tt.want)
		}
	}
}

// TestEveryFieldIsRead checks that every field the decoder knows is read into its place, in
// defaults and in a driver: a name listed as known but without a case of its own would be
// accepted and ignored.
func TestEveryFieldIsRead(t *testing.T) {
	cfg, err := Parse([]byte(`apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: /run/reg
drivers:
- {name: a.csi.k8s.io, type: CSIPlugin, endpoint: /run/a.sock, localEndpoint: /host/a.sock, supportedVersions: ["1.2.0"],
   socketName: s.sock, registrationTimeout: 4m, waitForEndpoint: true, required: false, healthTimeout: 4s,
   backoff: {initialInterval: 4s, maxInterval: 4m, multiplier: 4, randomizationFactor: 0.4}}
- {name: b.csi.k8s.io, type: CSIPlugin, endpoint: /run/b.sock}
defaults:
  backoff: {initialInterval: 3s, maxInterval: 3m, multiplier: 3, randomizationFactor: 0.3}
  registrationTimeout: 3m
  waitForEndpoint: false
  required: true
  healthTimeout: 300ms
`))
	if err != nil {
		t.Fatal(err)
	}
	want := &RegistrarConfig{RegistrationDir: "/run/reg", Drivers: []Driver{{
		Registration: Registration{Name: "a.csi.k8s.io", Type: CSIPlugin, Endpoint: "/run/a.sock",
			SupportedVersions: []string{"1.2.0"}, SocketName: "s.sock", SocketPath: "/run/reg/s.sock"},
		Local: Local{LocalEndpoint: "/host/a.sock"},
		Policy: Policy{Backoff: Backoff{InitialInterval: 4 * time.Second, MaxInterval: 4 * time.Minute, Multiplier: 4, RandomizationFactor: 0.4},
			RegistrationTimeout: 4 * time.Minute, WaitForEndpoint: true, Required: false, HealthTimeout: 4 * time.Second},
	}, {
		Registration: Registration{Name: "b.csi.k8s.io", Type: CSIPlugin, Endpoint: "/run/b.sock",
			SupportedVersions: []string{"1.0.0"}, SocketName: "b.csi.k8s.io-reg.sock", SocketPath: "/run/reg/b.csi.k8s.io-reg.sock"},
		Local: Local{LocalEndpoint: "/run/b.sock"},
		Policy: Policy{Backoff: Backoff{InitialInterval: 3 * time.Second, MaxInterval: 3 * time.Minute, Multiplier: 3, RandomizationFactor: 0.3},
			RegistrationTimeout: 3 * time.Minute, WaitForEndpoint: false, Required: true, HealthTimeout: 300 * time.Millisecond},
	}}}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("resolved config:\n got: %+v\nwant: %+v", cfg, want)
	}
}
