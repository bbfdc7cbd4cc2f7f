package config

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestParseInvalid runs one file per failure mode and expects exactly the listed errors,
// one per line, in file order.
func TestParseInvalid(t *testing.T) {
	tests := []struct {
		give string
		want []string
	}{
		{"syntax", []string{`yaml: line 6: mapping values are not allowed in this context`}},
		{"duplicate-key", []string{`yaml: line 6: key "name" already set in map`}},
		{"unknown-field", []string{`drivers: required: the list of drivers (write "drivers: []" for none)`, `driver: unknown field (did you mean "drivers"?)`}},
		{"unknown-driver-field", []string{`drivers[0].socketname: unknown field (did you mean "socketName"?)`}},
		{"case-mismatch", []string{`drivers[0].Endpoint: unknown field (did you mean "endpoint"?)`}},
		{"wrong-type-number", []string{`defaults.backoff.multiplier: "2": must be a number`}},
		{"wrong-type-list", []string{`drivers[0].supportedVersions: "1.0.0": must be a list`}},
		{"wrong-type-bool", []string{`defaults.waitForEndpoint: "false": must be true or false`}},
		{"required-not-bool", []string{`drivers[0].required: "always": must be true or false`}},
		{"wrong-type-string", []string{`drivers[0].name: ["nfs.csi.k8s.io"]: must be a string`}},
		{"drivers-not-list", []string{`drivers: {"name":"nfs.csi.k8s.io"}: must be a list`}},
		{"bad-duration", []string{`defaults.backoff.initialInterval: 5: must be a duration such as "500ms" or "2m"`}},
		{"bad-duration-words", []string{`drivers[0].registrationTimeout: "2 minutes": must be a duration such as "500ms" or "2m"`}},
		{"empty", []string{`the file is empty`}},
		{"not-mapping", []string{`top level: ["nfs.csi.k8s.io"]: must be a mapping with apiVersion, kind and drivers`}},
		{"missing-apiversion", []string{`apiVersion: required: must be "multireg.dev/v1alpha1"`}},
		{"apiversion", []string{`apiVersion: "multireg.dev/v1": must be "multireg.dev/v1alpha1"`}},
		{"missing-kind", []string{`kind: required: must be "RegistrarConfig"`}},
		{"kind", []string{`kind: "ConfigMap": must be "RegistrarConfig"`}},
		{"missing-name", []string{`drivers[0].name: required`}},
		{"csi-name", []string{`drivers[0].name: "nfs_csi": must be a DNS subdomain such as "nfs.csi.k8s.io": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character`}},
		{"csi-name-too-long", []string{`drivers[0].name: "` + strings.Repeat("a", 54) + `.csi.k8s.i": is 64 characters, at most 63 are allowed`}},
		{"dra-name", []string{`drivers[0].name: "gpu..example.com": must be a DNS subdomain such as "nfs.csi.k8s.io": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character`}},
		{"device-name-unprefixed", []string{`drivers[0].name: "gpu": must be an extended resource name such as "vendor.example/gpu" (a domain prefix outside kubernetes.io, a '/', and a name)`}},
		{"device-name-native", []string{`drivers[0].name: "kubernetes.io/gpu": must be an extended resource name such as "vendor.example/gpu" (a domain prefix outside kubernetes.io, a '/', and a name)`}},
		{"duplicate-name", []string{`drivers[1].name: "nfs.csi.k8s.io": duplicate of drivers[0].name`}},
		{"duplicate-socket", []string{`drivers[1].socketName: "nfs.csi.k8s.io-reg.sock": socket path "/var/lib/kubelet/plugins_registry/nfs.csi.k8s.io-reg.sock" is also used by drivers[0] ("nfs.csi.k8s.io")`}},
		{"socketname-slash", []string{`drivers[0].socketName: "sub/nfs.sock": must be a file name, without '/'`}},
		{"socketname-hidden", []string{`drivers[0].socketName: ".nfs.sock": must not start with '.': kubelet ignores hidden files`}},
		{"socketname-dotdot", []string{`drivers[0].socketName: "..": must not start with '.': kubelet ignores hidden files`}},
		{"relative-endpoint", []string{`drivers[0].endpoint: "csi.sock": must be an absolute path`}},
		{"relative-local-endpoint", []string{`drivers[0].localEndpoint: "host/csi.sock": must be an absolute path`}},
		{"relative-registration-dir", []string{`registrationDir: "var/lib/kubelet/plugins_registry": must be an absolute path`}},
		{"missing-endpoint", []string{`drivers[0].endpoint: required: the absolute path of the plugin's socket`}},
		{"endpoint-too-long", []string{`drivers[0].endpoint: "/var/lib/kubelet/plugins/` + strings.Repeat("n", 80) + `/csi.sock": is 114 bytes, more than the 107 a unix socket path allows`}},
		{"local-endpoint-too-long", []string{`drivers[0].localEndpoint: "/host/plugins/` + strings.Repeat("n", 90) + `/csi.sock": is 113 bytes, more than the 107 a unix socket path allows`}},
		{"socket-path-too-long", []string{`drivers[0].socketName: "nfs-driver-for-the-storage-team.csi.example.com-reg.sock" (default): socket path "/var/lib/kubelet-` + strings.Repeat("r", 40) + `/plugins_registry/nfs-driver-for-the-storage-team.csi.example.com-reg.sock" is 131 bytes, more than the 107 a unix socket path allows; set a shorter socketName or registrationDir`}},
		{"registration-dir-too-long", []string{`registrationDir: "/var/lib/kubelet-` + strings.Repeat("r", 58) + `/plugins_registry": is 92 bytes: a socket in it needs at least 17 more, and a unix socket path is at most 107 bytes`}},
		{"missing-type", []string{`drivers[0].type: required: one of CSIPlugin, DRAPlugin, DevicePlugin`}},
		{"unknown-type", []string{`drivers[0].type: "CSIDriver": must be one of CSIPlugin, DRAPlugin, DevicePlugin`}},
		{"csi-versions", []string{`drivers[0].supportedVersions: ["2.0.0"]: kubelet would reject it: the highest version below 2 must be 1.x with at least two parts, such as "1.0.0" (kubelet: could not find a highest supported version from versions ([2.0.0]) reported)`}},
		{"csi-version-one-part", []string{`drivers[0].supportedVersions: ["1"]: kubelet would reject it: the highest version below 2 must be 1.x with at least two parts, such as "1.0.0" (kubelet: could not find a highest supported version from versions ([1]) reported: illegal version string "1")`}},
		{"dra-versions", []string{`drivers[0].supportedVersions: ["v1alpha3"]: kubelet would reject it: must contain "v1.DRAPlugin" or "v1beta1.DRAPlugin"`}},
		{"device-versions", []string{`drivers[0].supportedVersions: ["v1"]: kubelet would reject it: must contain "v1beta1"`}},
		{"empty-versions", []string{`drivers[0].supportedVersions: must not be empty (leave it out for the default)`}},
		{"negative-interval", []string{`defaults.backoff.initialInterval: -1s: must be positive`}},
		{"zero-max-interval", []string{`drivers[0].backoff.maxInterval: 0s: must be positive`}},
		{"multiplier", []string{`defaults.backoff.multiplier: 0.5: must be at least 1`}},
		{"randomization-factor", []string{`defaults.backoff.randomizationFactor: 1.5: must be between 0 and 1`}},
		{"max-below-initial", []string{`defaults.backoff.maxInterval: 5s: must not be less than initialInterval (10s)`}},
		{"max-below-inherited-initial", []string{`drivers[0].backoff.maxInterval: 5s: must not be less than initialInterval (10s)`}},
		{"negative-timeout", []string{`defaults.registrationTimeout: -1m0s: must not be negative (0 disables the timeout)`}},
		{"short-timeout", []string{`drivers[0].registrationTimeout: 200ms: must be 0 (disabled) or at least 1s: kubelet looks for new sockets once a second`}},
		{"missing-drivers", []string{`drivers: required: the list of drivers (write "drivers: []" for none)`}},
		{"null-drivers", []string{`drivers: required: the list of drivers (write "drivers: []" for none)`}},
		{"short-interval", []string{`defaults.backoff.initialInterval: 1ms: must be at least 10ms`}},
		{"short-driver-intervals", []string{`drivers[0].backoff.initialInterval: 5ms: must be at least 10ms`, `drivers[0].backoff.maxInterval: 9ms: must be at least 10ms`}},
		{"zero-interval-number", []string{`defaults.backoff.initialInterval: 0s: must be positive`}},
		{"bare-number-duration", []string{`drivers[0].registrationTimeout: 0.5: must be a duration such as "500ms" or "2m"`}},
		{"infinite-multiplier", []string{`defaults.backoff.multiplier: .inf: must be a finite number`}},
		{"nan-randomization-factor", []string{`drivers[0].backoff.randomizationFactor: .nan: must be a finite number`}},
		{"infinite-duration", []string{`drivers[0].registrationTimeout: -.inf: must be a duration such as "500ms" or "2m"`}},
		{"not-utf8", []string{`drivers[0].socketName: "\xffnfs.sock": must be valid UTF-8`}},
		{"second-document", []string{`yaml: line 8: a second YAML document: a drivers file holds exactly one`}},
		{"second-document-syntax", []string{`yaml: line 8: did not find expected ',' or '}' (in a second YAML document: a drivers file holds exactly one)`}},
		{"merge-key", []string{`drivers[1]: line 9: YAML merge keys ("<<") are not supported: write the fields out`}},
		{"nul-registration-dir", []string{`registrationDir: "/var/lib/kubelet/plugins\x00_registry": must not contain a NUL byte`}},
		{"nul-endpoint", []string{`drivers[0].endpoint: "/var/lib/kubelet/plugins/csi-nfs\x00plugin/csi.sock": must not contain a NUL byte`}},
		{"nul-local-endpoint", []string{`drivers[0].localEndpoint: "/host/plugins/csi-nfsplugin/csi.sock\x00": must not contain a NUL byte`}},
		{"endpoint-url-characters", []string{`drivers[0].endpoint: "/run/csi#1/csi.sock": kubelet cannot dial a path with '#', '?', '%' or a control character: its gRPC client reads the path as a URL`}},
		{"socketname-url-characters", []string{`drivers[0].socketName: "nfs?reg.sock": kubelet cannot dial a path with '#', '?', '%' or a control character: its gRPC client reads the path as a URL`}},
		{"registration-dir-url-characters", []string{`registrationDir: "/var/lib/kubelet/plugins%25registry": kubelet cannot dial a path with '#', '?', '%' or a control character: its gRPC client reads the path as a URL`}},
		{"device-plugin-dir", []string{inDevicePluginDir(`drivers[0].endpoint: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"`, kubeletsDir, "/var/lib/kubelet/plugins")}},
		{"device-plugin-dir-pattern", []string{inDevicePluginDir(`drivers[0].endpoint: "/var/lib/kubelet/device-plugins/dp.*"`, kubeletsDir, "/var/lib/kubelet/plugins")}},
		{"device-plugin-dir-other-root", []string{inDevicePluginDir(`drivers[0].endpoint: "/var/lib/kubelet/device-plugins/nvidia-gpu.sock"`, kubeletsDir, "/var/lib/k0s/kubelet/plugins")}},
		{"device-plugin-dir-root", []string{inDevicePluginDir(`drivers[0].endpoint: "/var/lib/k0s/kubelet/device-plugins/x.sock"`, underRoot("/var/lib/k0s/kubelet/device-plugins"), "/var/lib/k0s/kubelet/plugins")}},
		{"device-plugin-dir-local-endpoint", []string{inDevicePluginDir(`drivers[0].localEndpoint: "/host/kubelet/device-plugins/x.sock"`, underRoot("/host/kubelet/device-plugins"), "/host/kubelet/plugins")}},
		{"endpoint-in-registry", []string{`drivers[0].endpoint: "/var/lib/kubelet/plugins_registry/nfs/csi.sock": is inside registrationDir "/var/lib/kubelet/plugins_registry": kubelet would take the plugin's socket for a registration socket`}},
		// What YAML 1.2 and the library's decoder would take otherwise: a number or a YAML 1.1
		// boolean as a string, a quoted "yes" as a boolean, a null key or entry dropped, a bad
		// entry dropped with the ones after it renumbered, a value reused by an alias reported once.
		{"number-name", []string{`drivers[0].name: 123: must be a string`}},
		{"yes-name", []string{`drivers[0].name: true: must be a string`}},
		{"quoted-yes", []string{`defaults.waitForEndpoint: "yes": must be true or false`}},
		{"null-key", []string{`drivers[0].null: unknown field`}},
		{"null-driver", []string{`drivers[0].type: required: one of CSIPlugin, DRAPlugin, DevicePlugin`, `drivers[0].name: required`, `drivers[0].endpoint: required: the absolute path of the plugin's socket`}},
		{"driver-not-mapping", []string{`drivers[0]: ["nfs.csi.k8s.io"]: must be a mapping`, `drivers[0].type: required: one of CSIPlugin, DRAPlugin, DevicePlugin`, `drivers[0].name: required`, `drivers[0].endpoint: required: the absolute path of the plugin's socket`, `drivers[1].endpoint: "csi.sock": must be an absolute path`}},
		{"alias-bad-value", []string{`drivers[0].backoff.initialInterval: 5: must be a duration such as "500ms" or "2m"`, `drivers[1].backoff.initialInterval: 5: must be a duration such as "500ms" or "2m"`}},
		{"flow-type-errors", []string{`drivers[0].backoff.multiplier: "2": must be a number`, `drivers[0].backoff.randomizationFactor: "0.1": must be a number`}},
	}
	seen := map[string]bool{}
	for _, tt := range tests {
		t.Run(tt.give, func(t *testing.T) {
			seen["invalid-"+tt.give+".yaml"] = true
			b, err := os.ReadFile(filepath.Join("testdata", "invalid-"+tt.give+".yaml"))
			if err != nil {
				t.Fatal(err)
			}
			cfg, err := Parse(b)
			if err == nil {
				t.Fatalf("Parse succeeded with %d drivers, want errors:\n%s", len(cfg.Drivers), strings.Join(tt.want, "\n"))
			}
			if got, want := err.Error(), strings.Join(tt.want, "\n"); got != want {
				t.Errorf("Parse errors:\n got: %s\nwant: %s", got, want)
			}
		})
	}
	// Every invalid-*.yaml file in testdata must be in the table.
	files, err := filepath.Glob(filepath.Join("testdata", "invalid-*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !seen[filepath.Base(f)] {
			t.Errorf("%s has no entry in the table", f)
		}
	}
	if len(files) < 25 {
		t.Errorf("%d failure modes in testdata, want at least 25", len(files))
	}
}

// kubeletsDir is how a refusal of an endpoint in kubelet's device-plugin directory names it;
// underRoot names the device-plugins directory under registrationDir's kubelet root.
const kubeletsDir = "kubelet's device-plugin directory /var/lib/kubelet/device-plugins"

func underRoot(dir string) string {
	return dir + ", kubelet's device-plugin directory on a node that links it with /var/lib/kubelet/device-plugins (which kubelet uses whatever its root)"
}

// inDevicePluginDir is the problem of a device plugin's endpoint (field and value) in the
// directory where, whose socket belongs under plugins.
func inDevicePluginDir(field, where, plugins string) string {
	return field + ": is in " + where + ", where device plugins register themselves through kubelet.sock and kubelet removes every socket " +
		"when it starts: a second registration of a connected plugin makes kubelet 1.37 refuse its endpoint until kubelet restarts. " +
		"Remove the driver if the plugin registers itself, or move its socket to a directory of its own under " + plugins + " (docs/drivers.md)"
}

// TestParseReportsEveryError checks that one pass reports every problem of a file, in file
// order, and that a field that failed to decode is not reported a second time.
func TestParseReportsEveryError(t *testing.T) {
	b := []byte(`apiVersion: multireg.dev/v1
kind: RegistrarConfig
defaults:
  backoff: {multiplier: 0.5}
drivers:
  - name: [bad]
    type: CSIPlugin
    endpoint: csi.sock
  - name: gpu
    type: DevicePlugin
    endpoint: /var/lib/kubelet/plugins/gpu/dp.sock
    supportedVersions: [v1]
    extra: 1
`)
	_, err := Parse(b)
	want := []string{
		`apiVersion: "multireg.dev/v1": must be "multireg.dev/v1alpha1"`,
		`defaults.backoff.multiplier: 0.5: must be at least 1`,
		`drivers[0].name: ["bad"]: must be a string`,
		`drivers[0].endpoint: "csi.sock": must be an absolute path`,
		`drivers[1].extra: unknown field`,
		`drivers[1].name: "gpu": must be an extended resource name such as "vendor.example/gpu" (a domain prefix outside kubernetes.io, a '/', and a name)`,
		`drivers[1].supportedVersions: ["v1"]: kubelet would reject it: must contain "v1beta1"`,
	}
	if err == nil {
		t.Fatal("Parse succeeded")
	}
	if got := err.Error(); got != strings.Join(want, "\n") {
		t.Errorf("Parse errors:\n got: %s\nwant: %s", got, strings.Join(want, "\n"))
	}
}

func TestParseValid(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "valid-*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no valid-*.yaml in testdata")
	}
	for _, f := range files {
		if _, err := Load(f); err != nil {
			t.Errorf("Load(%s): %v", f, err)
		}
	}
}

// TestMinimalResolves is the golden test: a minimal file yields a driver with every default
// folded in, so that no consumer ever applies a default itself.
func TestMinimalResolves(t *testing.T) {
	cfg, err := Load(filepath.Join("testdata", "valid-minimal.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	want := &RegistrarConfig{
		RegistrationDir: "/var/lib/kubelet/plugins_registry",
		Drivers: []Driver{{
			Registration: Registration{
				Name:              "nfs.csi.k8s.io",
				Type:              "CSIPlugin",
				Endpoint:          "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock",
				SupportedVersions: []string{"1.0.0"},
				SocketName:        "nfs.csi.k8s.io-reg.sock",
				SocketPath:        "/var/lib/kubelet/plugins_registry/nfs.csi.k8s.io-reg.sock",
			},
			Local: Local{LocalEndpoint: "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock"},
			Policy: Policy{
				Backoff: Backoff{
					InitialInterval:     500 * time.Millisecond,
					MaxInterval:         2 * time.Minute,
					Multiplier:          2,
					RandomizationFactor: 0.2,
				},
				RegistrationTimeout: 2 * time.Minute,
				HealthTimeout:       3 * time.Second,
				WaitForEndpoint:     true,
			},
		}},
	}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("resolved config:\n got: %+v\nwant: %+v", cfg, want)
	}
}

// TestOverridesResolve checks the precedence driver > defaults > built-in, field by field.
func TestOverridesResolve(t *testing.T) {
	cfg, err := Load(filepath.Join("testdata", "valid-full.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	nfs, dra, dev := cfg.Drivers[0], cfg.Drivers[1], cfg.Drivers[2]

	// The file's defaults: 2s, 1m, 1.5, 0.1, 90s, waitForEndpoint false.
	fileDefaults := Backoff{InitialInterval: 2 * time.Second, MaxInterval: time.Minute, Multiplier: 1.5, RandomizationFactor: 0.1}
	if dra.Backoff != fileDefaults || dra.RegistrationTimeout != 90*time.Second || dra.WaitForEndpoint {
		t.Errorf("DRA driver without overrides: backoff %+v, timeout %s, wait %v; want the file's defaults", dra.Backoff, dra.RegistrationTimeout, dra.WaitForEndpoint)
	}
	// The NFS driver overrides initialInterval only, disables the timeout, and waits.
	wantNFS := fileDefaults
	wantNFS.InitialInterval = 5 * time.Second
	if nfs.Backoff != wantNFS || nfs.RegistrationTimeout != 0 || !nfs.WaitForEndpoint {
		t.Errorf("NFS driver: backoff %+v, timeout %s, wait %v; want %+v, 0s, true", nfs.Backoff, nfs.RegistrationTimeout, nfs.WaitForEndpoint, wantNFS)
	}
	if nfs.LocalEndpoint != "/host/plugins/csi-nfsplugin/csi.sock" || nfs.Endpoint != "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock" {
		t.Errorf("NFS endpoints: %q, local %q", nfs.Endpoint, nfs.LocalEndpoint)
	}
	if want := []string{"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"}; !reflect.DeepEqual(dra.SupportedVersions, want) {
		t.Errorf("DRA versions %q, want %q", dra.SupportedVersions, want)
	}
	if want := []string{"v1beta1"}; !reflect.DeepEqual(dev.SupportedVersions, want) {
		t.Errorf("device plugin default versions %q, want %q", dev.SupportedVersions, want)
	}
	if want := "/var/lib/kubelet/plugins_registry/vendor.example_gpu-reg.sock"; dev.SocketPath != want {
		t.Errorf("device plugin socket path %q, want %q", dev.SocketPath, want)
	}
	if got, want := cfg.Summary(), "3 drivers (1 CSIPlugin, 1 DRAPlugin, 1 DevicePlugin) in /var/lib/kubelet/plugins_registry"; got != want {
		t.Errorf("Summary() = %q, want %q", got, want)
	}
}

func TestDefaultVersionsPerType(t *testing.T) {
	tests := []struct {
		typ, name string
		want      []string
	}{
		{CSIPlugin, "nfs.csi.k8s.io", []string{"1.0.0"}},
		{DRAPlugin, "gpu.example.com", []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}},
		{DevicePlugin, "vendor.example/gpu", []string{"v1beta1"}},
	}
	for _, tt := range tests {
		b := []byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n- name: " + tt.name +
			"\n  type: " + tt.typ + "\n  endpoint: /run/p.sock\n")
		cfg, err := Parse(b)
		if err != nil {
			t.Fatalf("%s: %v", tt.typ, err)
		}
		if got := cfg.Drivers[0].SupportedVersions; !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s default versions %q, want %q", tt.typ, got, tt.want)
		}
	}
}

func TestDefaultSocketName(t *testing.T) {
	tests := []struct{ give, want string }{
		{"nfs.csi.k8s.io", "nfs.csi.k8s.io-reg.sock"},
		{"vendor.example/gpu", "vendor.example_gpu-reg.sock"},
		{"Upper.Case-ok_1", "Upper.Case-ok_1-reg.sock"},
		{"a b:c", "a_b_c-reg.sock"},
	}
	for _, tt := range tests {
		if got := DefaultSocketName(tt.give); got != tt.want {
			t.Errorf("DefaultSocketName(%q) = %q, want %q", tt.give, got, tt.want)
		}
	}
}

// TestLengthLimitsAreInclusive pins the 107-byte limit: 107 is accepted, 108 is not.
func TestLengthLimitsAreInclusive(t *testing.T) {
	for _, n := range []int{107, 108} {
		ep := "/" + strings.Repeat("e", n-len("/.sock")) + ".sock"
		b := []byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n- name: nfs.csi.k8s.io\n  type: CSIPlugin\n  endpoint: " + ep + "\n")
		_, err := Parse(b)
		if (err == nil) != (n <= MaxSocketPathLen) {
			t.Errorf("endpoint of %d bytes: err = %v", n, err)
		}
	}
}

func TestLoadRefusesLargeFileWithoutReadingIt(t *testing.T) {
	path := filepath.Join(t.TempDir(), "huge.yaml")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	// A sparse 64 GiB file: reading it whole would take minutes and all memory.
	if err := f.Truncate(64 << 30); err != nil {
		t.Fatal(err)
	}
	f.Close()
	_, err = Load(path)
	if err == nil || !strings.Contains(err.Error(), "larger than 1048576 bytes (1 MiB)") {
		t.Fatalf("Load of a 64 GiB file: %v, want a size error", err)
	}

	// Exactly 1 MiB is accepted as far as size goes (it then fails as YAML of comments).
	exact := filepath.Join(t.TempDir(), "exact.yaml")
	if err := os.WriteFile(exact, []byte("#"+strings.Repeat("x", MaxFileSize-2)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(exact); err == nil || !strings.Contains(err.Error(), "the file is empty") {
		t.Errorf("Load of exactly 1 MiB: %v, want it read and found empty", err)
	}
}

func TestLoadNamesFileOnEveryLine(t *testing.T) {
	path := filepath.Join("testdata", "invalid-not-mapping.yaml")
	_, err := Load(path)
	if err == nil {
		t.Fatal("Load succeeded")
	}
	for line := range strings.SplitSeq(err.Error(), "\n") {
		if !strings.HasPrefix(line, path+": ") {
			t.Errorf("line %q does not start with the file's path", line)
		}
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load of a missing file: %v, want os.ErrNotExist", err)
	}
}

// TestBareZeroDuration checks that a bare 0 is a duration: it disables registrationTimeout.
func TestBareZeroDuration(t *testing.T) {
	cfg, err := Load(filepath.Join("testdata", "valid-bare-zero.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Drivers[0].RegistrationTimeout; got != 0 {
		t.Errorf("registrationTimeout %s, want 0 (disabled)", got)
	}
}

// TestYAML11Booleans checks that yes and off are booleans, as they always were in a drivers
// file, although YAML 1.2 reads them as strings.
func TestYAML11Booleans(t *testing.T) {
	cfg, err := Load(filepath.Join("testdata", "valid-yaml11-booleans.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.Drivers[0].WaitForEndpoint {
		t.Errorf("waitForEndpoint: yes read as %v", cfg.Drivers[0].WaitForEndpoint)
	}
	cfg, err = Parse([]byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndefaults: {waitForEndpoint: off}\ndrivers:\n- {name: a.csi.k8s.io, type: CSIPlugin, endpoint: /run/a.sock}\n"))
	if err != nil || cfg.Drivers[0].WaitForEndpoint {
		t.Errorf("defaults.waitForEndpoint: off: %v, %+v", err, cfg)
	}
}

// TestAnchorsResolve checks that an alias stands for the whole value it names.
func TestAnchorsResolve(t *testing.T) {
	cfg, err := Load(filepath.Join("testdata", "valid-anchors.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	want := Backoff{InitialInterval: 5 * time.Second, MaxInterval: 5 * time.Minute, Multiplier: 2, RandomizationFactor: 0.2}
	for _, d := range cfg.Drivers {
		if d.Backoff != want || !reflect.DeepEqual(d.SupportedVersions, []string{"1.0.0"}) {
			t.Errorf("%s: backoff %+v, versions %q; want %+v, [\"1.0.0\"]", d.Name, d.Backoff, d.SupportedVersions, want)
		}
	}
}

// TestSecondDocumentDoesNotHideOtherErrors checks that the first document is still checked.
func TestSecondDocumentDoesNotHideOtherErrors(t *testing.T) {
	b := []byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n- name: nfs.csi.k8s.io\n  type: CSIPlugin\n  endpoint: csi.sock\n--- ~\n")
	_, err := Parse(b)
	want := "yaml: line 7: a second YAML document: a drivers file holds exactly one\n" +
		`drivers[0].endpoint: "csi.sock": must be an absolute path`
	if err == nil || err.Error() != want {
		t.Errorf("Parse errors:\n got: %v\nwant: %s", err, want)
	}
}

// TestParseHostile feeds inputs meant to exhaust the parser. Each must end with the
// expected verdict (the test's own timeout is the bound on time).
func TestParseHostile(t *testing.T) {
	header := "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\n"
	var laughs strings.Builder
	laughs.WriteString("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n")
	for i := 1; i < 10; i++ {
		fmt.Fprintf(&laughs, "a%d: &a%d [%s]\n", i, i, strings.TrimSuffix(strings.Repeat(fmt.Sprintf("*a%d, ", i-1), 10), ", "))
	}
	var many strings.Builder
	many.WriteString(header + "drivers:\n")
	for i := range 12000 {
		fmt.Fprintf(&many, "- name: d%d.csi.example.com\n  type: CSIPlugin\n  endpoint: /run/d%d/csi.sock\n", i, i)
	}
	garbage := make([]byte, 1<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range garbage {
		garbage[i] = byte(rng.IntN(256))
	}
	tests := []struct {
		name    string
		give    string
		wantErr string // "" for valid
	}{
		{"50 MB", header + strings.Repeat("#", 50<<20), "larger than 1048576 bytes (1 MiB)"},
		{"billion laughs", header + laughs.String() + "drivers: *a9\n", "excessive aliasing"},
		{"billion laughs in a second document", header + "drivers: []\n---\n" + laughs.String(), "a second YAML document"},
		{"deep flow nesting", header + "drivers: " + strings.Repeat("[", 50000) + strings.Repeat("]", 50000) + "\n", "exceeded max depth"},
		{"deep block nesting", header + "drivers:\n" + strings.Repeat("- ", 50000) + "x\n", "exceeded max depth"},
		{"binary garbage", string(garbage), "yaml: "},
		{"BOM and CRLF", "\ufeff" + strings.ReplaceAll(header+"drivers: []\n", "\n", "\r\n"), ""},
		{"12,000 drivers", many.String(), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Parse([]byte(tt.give))
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Parse: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("Parse: %v, want an error with %q", err, tt.wantErr)
			case err == nil:
				checkInvariants(t, cfg)
			}
		})
	}
}

// TestReadFileRefusesNonRegular checks that anything but a regular file is refused at once,
// with what it is: opening a named pipe would otherwise wait for a writer forever.
func TestReadFileRefusesNonRegular(t *testing.T) {
	dir, err := os.MkdirTemp("", "cfg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	fifo := filepath.Join(dir, "fifo.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.yaml")
	if err := os.Symlink(fifo, link); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s.yaml")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	tests := []struct{ path, want string }{
		{fifo, "is a named pipe (FIFO), not a regular file"},
		{link, "is a named pipe (FIFO), not a regular file"},
		{dir, "is a directory, not a regular file"},
		{sock, "is a unix socket, not a regular file"},
	}
	if fi, err := os.Stat("/dev/zero"); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		tests = append(tests, struct{ path, want string }{"/dev/zero", "is a character device, not a regular file"})
	}
	for _, tt := range tests {
		err := readReturning(t, tt.path)
		if want := "read config " + tt.path + ": " + tt.want; err == nil || err.Error() != want {
			t.Errorf("ReadFile(%s): %v, want %q", tt.path, err, want)
		}
	}
}

// readReturning runs ReadFile(path) and fails the test if it has not returned within 10s; it
// then opens the named pipe at path for writing, which releases a reader blocked in open(2).
func readReturning(t *testing.T, path string) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := ReadFile(path)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		if w, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			w.Close()
		}
		<-done
		t.Fatalf("ReadFile(%s) had not returned after 10s", path)
		return nil
	}
}

// TestReadInputPipes: ReadInput reads a named pipe and a character device like standard input,
// up to MaxManifestSize bytes exactly, and refuses one byte more.
func TestReadInputPipes(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "in.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{MaxManifestSize, MaxManifestSize + 1} {
		done := make(chan error, 1)
		go func() {
			w, err := os.OpenFile(fifo, os.O_WRONLY, 0)
			if err == nil {
				_, err = w.Write(make([]byte, n))
				w.Close()
			}
			done <- err
		}()
		b, err := ReadInput(fifo, nil)
		switch {
		case n <= MaxManifestSize && (err != nil || len(b) != n):
			t.Errorf("ReadInput(a FIFO of %d bytes): %d bytes, %v; want them all", n, len(b), err)
		case n > MaxManifestSize && (err == nil || !strings.Contains(err.Error(), "larger than 16777216 bytes")):
			t.Errorf("ReadInput(a FIFO of %d bytes): %d bytes, %v; want it refused", n, len(b), err)
		}
		// A writer left waiting (the FIFO refused, or read in part) is let through by
		// readers that read nothing, until it returns.
		for released := false; !released; {
			r, err := os.OpenFile(fifo, os.O_RDONLY|syscall.O_NONBLOCK, 0)
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-done:
				released = true
			case <-time.After(10 * time.Millisecond):
			}
			r.Close()
		}
	}
	if fi, err := os.Stat("/dev/zero"); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		if _, err := ReadInput("/dev/zero", nil); err == nil || err.Error() != "read config /dev/zero: larger than 16777216 bytes (16 MiB), the most multireg validate reads" {
			t.Errorf("ReadInput(/dev/zero): %v; want it read up to the bound, and refused", err)
		}
	}
}
