package config

import "testing"

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
