package config

import (
	"slices"
	"strings"
	"testing"
)

// parseDriver parses a file with one driver whose entry holds the YAML lines entry (indented
// by four spaces).
func parseDriver(entry string) (*RegistrarConfig, error) {
	return Parse([]byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n  - " + strings.TrimPrefix(entry, "    ")))
}

func TestEndpointPatternResolves(t *testing.T) {
	cfg, err := parseDriver(`    name: gpu.example.com
    type: DRAPlugin
    endpoint: /var/lib/kubelet/plugins/gpu.example.com/dra-*.sock
    localEndpoint: /host/plugins/gpu.example.com/dra-*.sock
`)
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.Drivers[0]
	if !d.EndpointIsPattern() || !d.RollsOver() {
		t.Fatalf("EndpointIsPattern %v, RollsOver %v; want both", d.EndpointIsPattern(), d.RollsOver())
	}
	if want := "/var/lib/kubelet/plugins_registry/gpu.example.com-reg.1.sock"; d.AltSocketPath != want {
		t.Errorf("AltSocketPath %q, want %q", d.AltSocketPath, want)
	}
	if got := d.SocketNames(); len(got) != 2 || got[1] != "gpu.example.com-reg.1.sock" {
		t.Errorf("SocketNames %q, want both sockets", got)
	}
	ep, local := d.Concrete("dra-1234.sock")
	if ep != "/var/lib/kubelet/plugins/gpu.example.com/dra-1234.sock" || local != "/host/plugins/gpu.example.com/dra-1234.sock" {
		t.Errorf("Concrete = %q, %q", ep, local)
	}

	// A device plugin with a pattern has a second socket too: kubelet 1.37 and later keep
	// several endpoints of one resource, and its registration rolls over there. It does not
	// roll over whatever the kubelet (AlwaysRollsOver): older kubelets keep one per name.
	cfg, err = parseDriver(`    name: example.com/widget
    type: DevicePlugin
    endpoint: /var/lib/kubelet/plugins/widget/dp.*
`)
	if err != nil {
		t.Fatal(err)
	}
	if d := cfg.Drivers[0]; !d.RollsOver() || d.AlwaysRollsOver() || d.AltSocketPath != "/var/lib/kubelet/plugins_registry/example.com_widget-reg.1.sock" {
		t.Errorf("device plugin: RollsOver %v, AlwaysRollsOver %v, AltSocketPath %q", d.RollsOver(), d.AlwaysRollsOver(), d.AltSocketPath)
	}
	// A device plugin has a third registration socket: kubelet may hold both others for a
	// reconcile pass when a move's drop is repaired.
	if d := cfg.Drivers[0]; d.SparePath != "/var/lib/kubelet/plugins_registry/example.com_widget-reg.2.sock" ||
		!slices.Equal(d.SocketNames(), []string{"example.com_widget-reg.sock", "example.com_widget-reg.1.sock", "example.com_widget-reg.2.sock"}) {
		t.Errorf("device plugin: SparePath %q, SocketNames %q", d.SparePath, d.SocketNames())
	}
	// A CSI driver with a pattern never rolls over: kubelet keeps one registration per name.
	cfg, err = parseDriver(`    name: nfs.csi.k8s.io
    type: CSIPlugin
    endpoint: /var/lib/kubelet/plugins/nfs/csi-*.sock
`)
	if err != nil {
		t.Fatal(err)
	}
	if d := cfg.Drivers[0]; d.RollsOver() || d.AltSocketPath != "" {
		t.Errorf("CSI driver: RollsOver %v, AltSocketPath %q", d.RollsOver(), d.AltSocketPath)
	}

	// '[' and '\' without '*' or '?' are the name's own characters, as before patterns.
	cfg, err = parseDriver(`    name: gpu.example.com
    type: DRAPlugin
    endpoint: /var/lib/kubelet/plugins/gpu/dra[1].sock
`)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Drivers[0].EndpointIsPattern() {
		t.Error("a literal name with '[' taken for a pattern")
	}

	// A localEndpoint alone may hold any byte: a '?' there is no pattern.
	cfg, err = parseDriver(`    name: nfs.csi.k8s.io
    type: CSIPlugin
    endpoint: /var/lib/kubelet/plugins/nfs/csi.sock
    localEndpoint: /host/a?b/csi.sock
`)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Drivers[0].EndpointIsPattern() {
		t.Error("a literal localEndpoint taken for a pattern")
	}
}

func TestEndpointPatternInvalid(t *testing.T) {
	long := "/var/lib/kubelet/plugins/" + strings.Repeat("n", 79) + "/dp.*"
	tests := []struct{ entry, want string }{
		{"endpoint: /var/lib/kubelet/plugins/*/dra.sock",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/*/dra.sock": a pattern is allowed only in the last element (the socket's name), not in "/var/lib/kubelet/plugins/*"`},
		{"endpoint: /var/lib/kubelet/plugins/gpu/dra-[0-9]*.sock",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/gpu/dra-[0-9]*.sock": the pattern "dra-[0-9]*.sock" holds '[' or '\': a pattern is made of '*' (any characters) and '?' (any one character) only`},
		{"endpoint: /var/lib/kubelet/plugins/gpu/*",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/gpu/*": the pattern "*" has no character of its own`},
		{"endpoint: /var/lib/kubelet/plugins/gpu/?*",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/gpu/?*": the pattern "?*" has no character of its own`},
		{"endpoint: /var/lib/kubelet/plugins/a?b/dra-*.sock",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/a?b/dra-*.sock": kubelet cannot dial a path with '#', '?'`},
		{"endpoint: " + long,
			`drivers[0].endpoint: "` + long + `": leaves no room for a socket name: the shortest path the pattern matches is 108 bytes`},
		{"endpoint: /var/lib/kubelet/plugins/gpu#1/dra-*.sock",
			`drivers[0].endpoint: "/var/lib/kubelet/plugins/gpu#1/dra-*.sock": kubelet cannot dial a path with '#'`},
		{"endpoint: /var/lib/kubelet/plugins/gpu/dra-*.sock\n    localEndpoint: /host/gpu/dra.sock",
			`drivers[0].localEndpoint: "/host/gpu/dra.sock": must end in the same pattern as endpoint ("dra-*.sock")`},
		{"endpoint: /var/lib/kubelet/plugins/gpu/dra-*.sock\n    waitForEndpoint: false",
			`drivers[0].waitForEndpoint: false: must be true when endpoint is a pattern`},
	}
	for _, tt := range tests {
		_, err := parseDriver("    name: gpu.example.com\n    type: DRAPlugin\n    " + tt.entry + "\n")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s:\n got %v\nwant %s", tt.entry, err, tt.want)
		}
	}
}

// TestAltSocketCollides: a driver's second registration socket may not be another's socket.
func TestAltSocketCollides(t *testing.T) {
	_, err := Parse([]byte(`apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
drivers:
  - name: gpu.example.com
    type: DRAPlugin
    endpoint: /var/lib/kubelet/plugins/gpu/dra-*.sock
  - name: fpga.example.com
    type: DRAPlugin
    endpoint: /var/lib/kubelet/plugins/fpga/dra.sock
    socketName: gpu.example.com-reg.1.sock
`))
	want := `drivers[1].socketName: "gpu.example.com-reg.1.sock": socket path "/var/lib/kubelet/plugins_registry/gpu.example.com-reg.1.sock" is also used by drivers[0] ("gpu.example.com")`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("got %v\nwant %s", err, want)
	}
}

func TestAltSocketName(t *testing.T) {
	for give, want := range map[string]string{
		"gpu.example.com-reg.sock": "gpu.example.com-reg.1.sock",
		"gpu":                      "gpu.1",
	} {
		if got := AltSocketName(give); got != want {
			t.Errorf("AltSocketName(%q) = %q, want %q", give, got, want)
		}
	}
}
