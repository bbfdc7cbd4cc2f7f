//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/testkit"
	"multireg.dev/multireg/nodecond"
	"multireg.dev/multireg/nodecond/relay"
	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

var t0 = time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)

// knownStates are three drivers, one in each state an SRE asks about.
var knownStates = []registrar.DriverStatus{
	{Name: "a.csi.example.com", Type: "CSIPlugin", Phase: registrar.Registered, Socket: "/reg/a-reg.sock", Endpoint: "/p/a.sock", EndpointUp: true, Attempts: 1, Since: t0},
	{Name: "b.csi.example.com", Type: "CSIPlugin", Phase: registrar.BackingOff, Socket: "/reg/b-reg.sock", Endpoint: "/p/b.sock", EndpointUp: true, Attempts: 2, Failures: 2,
		LastError: "kubelet rejected the registration: RegisterPlugin error -- plugin registration failed with err: NodeGetInfo failed", Since: t0, NextAttempt: t0.Add(4 * time.Second)},
	{Name: "example.com/gpu", Type: "DevicePlugin", Phase: registrar.WaitingForEndpoint, Socket: "/reg/example.com_gpu-reg.sock", Endpoint: "/p/gpu.sock",
		LastError: "endpoint /p/gpu.sock does not accept connections: no such file or directory", Since: t0, NextAttempt: t0.Add(time.Second)},
}

func testState(drivers []registrar.DriverStatus, loops int32) *daemonState {
	st := &daemonState{
		drivers: func() []registrar.DriverStatus { return drivers },
		config: func() reload.State {
			return reload.State{Path: "/etc/multireg/config.yaml", Generation: 3, LastReloadSuccessful: true, LastReloadTime: t0}
		},
	}
	st.loops.Store(loops)
	return st
}

// serving is an instance that serves with st.
func serving(st *daemonState) *instance {
	in := newInstance()
	in.serve(st, prometheus.NewRegistry(), "holds the registration directory")
	return in
}

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// TestReadyzAbsent: a driver absent from this node is named and not counted, unless it is
// required; a present driver that is not registered still fails readiness.
func TestReadyzAbsent(t *testing.T) {
	absent := registrar.DriverStatus{Name: "example.com/fpga", Type: "DevicePlugin", Phase: registrar.WaitingForEndpoint, Absent: true,
		LastError: "endpoint /p/fpga.sock does not accept connections: no such file or directory", Since: t0}
	required := absent
	required.Name, required.Required = "example.com/nic", true
	for _, tt := range []struct {
		name     string
		drivers  []registrar.DriverStatus
		path     string
		wantCode int
		want     []string
	}{
		{"absent", []registrar.DriverStatus{knownStates[0], absent}, "/readyz", 200,
			[]string{"ok: 1 of 2 drivers registered, 1 absent from this node", "absent (not required): example.com/fpga"}},
		{"one absent driver", []registrar.DriverStatus{knownStates[0], absent}, "/readyz/example.com/fpga", 200,
			[]string{"ok: 0 of 1 drivers registered, 1 absent from this node"}},
		{"absent and required", []registrar.DriverStatus{knownStates[0], absent, required}, "/readyz", 503,
			[]string{"not ready: 1 of 3 drivers not registered",
				"example.com/nic: WaitingForEndpoint: required, and absent from this node: endpoint /p/fpga.sock",
				"absent (not required): example.com/fpga"}},
		{"absent beside a present one not registered", append(slices.Clone(knownStates), absent), "/readyz", 503,
			[]string{"not ready: 2 of 4 drivers not registered", "b.csi.example.com: BackingOff", "example.com/gpu: WaitingForEndpoint",
				"absent (not required): example.com/fpga"}},
	} {
		code, body := get(t, newHandler(serving(testState(tt.drivers, 2)), nil), tt.path)
		if code != tt.wantCode {
			t.Errorf("%s: GET %s: %d, want %d\n%s", tt.name, tt.path, code, tt.wantCode, body)
		}
		rest := body
		for _, w := range tt.want {
			i := strings.Index(rest, w)
			if i < 0 {
				t.Errorf("%s: GET %s: %q missing or out of order in:\n%s", tt.name, tt.path, w, body)
				break
			}
			rest = rest[i+len(w):]
		}
	}
}

func TestHandlers(t *testing.T) {
	h := newHandler(serving(testState(knownStates, 2)), nil)
	tests := []struct {
		path     string
		wantCode int
		want     []string // substrings, in order
	}{
		{"/healthz", 200, []string{"ok"}},
		{"/readyz", 503, []string{
			"not ready: 2 of 3 drivers not registered",
			"b.csi.example.com: BackingOff: kubelet rejected the registration: RegisterPlugin error -- plugin registration failed with err: NodeGetInfo failed",
			"example.com/gpu: WaitingForEndpoint: endpoint /p/gpu.sock does not accept connections",
		}},
		{"/readyz/a.csi.example.com", 200, []string{"ok: 1 of 1 drivers registered"}},
		{"/readyz/b.csi.example.com", 503, []string{"b.csi.example.com: BackingOff: kubelet rejected"}},
		{"/readyz/example.com/gpu", 503, []string{"example.com/gpu: WaitingForEndpoint"}},
		{"/readyz/nope", 404, []string{`no driver "nope"`}},
	}
	for _, tt := range tests {
		code, body := get(t, h, tt.path)
		if code != tt.wantCode {
			t.Errorf("GET %s: %d, want %d\n%s", tt.path, code, tt.wantCode, body)
		}
		rest := body
		for _, w := range tt.want {
			i := strings.Index(rest, w)
			if i < 0 {
				t.Errorf("GET %s: body lacks %q (in order):\n%s", tt.path, w, body)
				break
			}
			rest = rest[i+len(w):]
		}
	}
	if _, body := get(t, h, "/readyz"); strings.Contains(body, "a.csi.example.com") {
		t.Errorf("/readyz lists a registered driver:\n%s", body)
	}

	// Every configured driver registered (or none configured): ready.
	for _, ds := range [][]registrar.DriverStatus{knownStates[:1], nil} {
		if code, body := get(t, newHandler(serving(testState(ds, 2)), nil), "/readyz"); code != 200 {
			t.Errorf("/readyz with %d drivers all registered: %d\n%s", len(ds), code, body)
		}
	}
	// Handing the directory over: not ready (a probe of the new pod may reach this process
	// until the new instance has the port's socket), whatever the drivers; ready again when the
	// hand-over fails and the loops resume.
	in := serving(testState(knownStates[:1], 2))
	in.handingOver(true)
	if code, body := get(t, newHandler(in, nil), "/readyz"); code != 503 || !strings.Contains(body, "handing the registration directory over") {
		t.Errorf("/readyz while handing over: %d %q, want 503 saying so", code, body)
	}
	in.handingOver(false)
	if code, body := get(t, newHandler(in, nil), "/readyz"); code != 200 {
		t.Errorf("/readyz after a hand-over failed: %d %q, want 200", code, body)
	}
	// A loop that stopped: not healthy.
	if code, _ := get(t, newHandler(serving(testState(knownStates, 1)), nil), "/healthz"); code != 503 {
		t.Errorf("/healthz with a loop stopped: %d, want 503", code)
	}
}

func TestStatusDocument(t *testing.T) {
	h := newHandler(serving(testState(knownStates, 2)), nil)
	code, body := get(t, h, "/status")
	if code != 200 {
		t.Fatalf("GET /status: %d", code)
	}
	// The exact shape the README documents for /status: field names, RFC 3339 times, null for no time.
	var doc map[string]any
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatal(err)
	}
	cfg := doc["config"].(map[string]any)
	for _, k := range []string{"path", "generation", "lastReloadSuccessful", "lastReloadError", "lastReloadTime"} {
		if _, ok := cfg[k]; !ok {
			t.Errorf("config lacks %q: %v", k, cfg)
		}
	}
	drivers := doc["drivers"].([]any)
	if len(drivers) != 3 {
		t.Fatalf("%d drivers, want 3", len(drivers))
	}
	want := map[string]any{
		"name": "b.csi.example.com", "type": "CSIPlugin", "phase": "BackingOff", "socket": "/reg/b-reg.sock",
		"endpoint": "/p/b.sock", "endpointUp": true, "absent": false, "required": false, "heldByOther": false, "attempts": 2.0, "failures": 2.0,
		"lastError":   knownStates[1].LastError,
		"since":       "2026-11-21T10:00:00Z",
		"nextAttempt": "2026-11-21T10:00:04Z",
	}
	got := drivers[1].(map[string]any)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("drivers[1].%s = %v, want %v", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("drivers[1] has fields %v, want exactly %v", got, want)
	}
	if drivers[0].(map[string]any)["nextAttempt"] != nil {
		t.Errorf("a registered driver's nextAttempt: %v, want null", drivers[0].(map[string]any)["nextAttempt"])
	}
}

// printStatus prints a document held whole as multireg status prints it.
func printStatus(w io.Writer, doc statusDoc, now time.Time) {
	// As `multireg status` prints it: from the document on the wire.
	body, err := json.Marshal(doc)
	if err != nil {
		panic(err)
	}
	read, err := decodeStatus(body, func(driverStatus) {})
	if err != nil {
		panic(err)
	}
	printStatusTable(w, read, func(each func(driverStatus)) error {
		_, err := decodeStatus(body, each)
		return err
	}, now)
}

func TestStatusTable(t *testing.T) {
	var out bytes.Buffer
	printStatus(&out, newStatusDoc(serving(testState(knownStates, 2)).view()), t0.Add(time.Second))
	want := `config /etc/multireg/config.yaml (generation 3): applied
1 of 3 drivers registered

DRIVER             TYPE          PHASE               SINCE  ATTEMPTS  FAILURES  NEXT RETRY  LAST ERROR
a.csi.example.com  CSIPlugin     Registered          1s     1         0         -           -
b.csi.example.com  CSIPlugin     BackingOff          1s     2         2         in 3s       kubelet rejected the registration: RegisterPlugin error -- plugin registration failed with err: NodeGetInfo failed
example.com/gpu    DevicePlugin  WaitingForEndpoint  1s     0         0         in 0s       endpoint /p/gpu.sock does not accept connections: no such file or directory
`
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
}

// TestStatusTableAbsent: a driver absent from this node reads Absent, without the probe's
// error; a required one says it fails readiness.
func TestStatusTableAbsent(t *testing.T) {
	absent := registrar.DriverStatus{Name: "example.com/fpga", Type: "DevicePlugin", Phase: registrar.WaitingForEndpoint, Absent: true,
		LastError: "endpoint /p/fpga.sock does not accept connections: no such file or directory", Since: t0}
	required := absent
	required.Name, required.Required = "example.com/nic", true
	var out bytes.Buffer
	printStatus(&out, newStatusDoc(serving(testState([]registrar.DriverStatus{knownStates[0], absent, required}, 2)).view()), t0.Add(time.Second))
	want := `config /etc/multireg/config.yaml (generation 3): applied
1 of 3 drivers registered, 2 absent from this node

DRIVER             TYPE          PHASE       SINCE  ATTEMPTS  FAILURES  NEXT RETRY  LAST ERROR
a.csi.example.com  CSIPlugin     Registered  1s     1         0         -           -
example.com/fpga   DevicePlugin  Absent      1s     0         0         -           -
example.com/nic    DevicePlugin  Absent      1s     0         0         -           required on every node: not ready
`
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
}

// TestStatusTableAbsentRejected: a driver absent from this node, published all the same
// (waitForEndpoint: false) and rejected by kubelet, reads as the JSON document says it:
// BackingOff, with kubelet's reason.
func TestStatusTableAbsentRejected(t *testing.T) {
	rejected := registrar.DriverStatus{Name: "nfs.csi.k8s.io", Type: "CSIPlugin", Phase: registrar.BackingOff, Absent: true,
		Attempts: 3, Failures: 3, LastError: "kubelet rejected the registration: RegisterPlugin error -- dial unix /p/csi.sock: connect: no such file or directory",
		Since: t0, NextAttempt: t0.Add(4 * time.Second)}
	published := rejected
	published.Name, published.Phase, published.LastError, published.NextAttempt = "other.csi.k8s.io", registrar.Serving, "", time.Time{}
	var out bytes.Buffer
	doc := newStatusDoc(serving(testState([]registrar.DriverStatus{rejected, published}, 2)).view())
	printStatus(&out, doc, t0.Add(time.Second))
	want := `config /etc/multireg/config.yaml (generation 3): applied
0 of 2 drivers registered, 2 absent from this node

DRIVER            TYPE       PHASE       SINCE  ATTEMPTS  FAILURES  NEXT RETRY  LAST ERROR
nfs.csi.k8s.io    CSIPlugin  BackingOff  1s     3         3         in 3s       endpoint absent from this node; kubelet rejected the registration: RegisterPlugin error -- dial unix /p/csi.sock: connect: no such file or directory
other.csi.k8s.io  CSIPlugin  Serving     1s     3         3         -           endpoint absent from this node
`
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
	if d := doc.Drivers[0]; d.Phase != "BackingOff" || !strings.Contains(d.LastError, "kubelet rejected") {
		t.Errorf("JSON: %+v, want BackingOff with kubelet's reason", d)
	}
}

// TestStatusKubeletColumn: a device plugin's view from kubelet's pod-resources API is a
// KUBELET column, and a registered plugin whose devices kubelet no longer holds says so; the
// JSON document carries the view.
func TestStatusKubeletColumn(t *testing.T) {
	gpu := registrar.DriverStatus{Name: "example.com/gpu", Type: "DevicePlugin", Phase: registrar.Registered, EndpointUp: true, Attempts: 1,
		Since: t0, Kubelet: &registrar.KubeletView{Devices: 4, ReadAt: t0.Add(time.Second), Since: t0}}
	nic := gpu
	nic.Name, nic.Kubelet = "example.com/nic", &registrar.KubeletView{ReadAt: t0.Add(time.Second), Since: t0.Add(-11 * time.Second), Missing: true}
	csi := registrar.DriverStatus{Name: "nfs.csi.k8s.io", Type: "CSIPlugin", Phase: registrar.Registered, EndpointUp: true, Attempts: 1, Since: t0}
	var out bytes.Buffer
	doc := newStatusDoc(serving(testState([]registrar.DriverStatus{gpu, nic, csi}, 2)).view())
	printStatus(&out, doc, t0.Add(time.Second))
	want := `config /etc/multireg/config.yaml (generation 3): applied
3 of 3 drivers registered

DRIVER           TYPE          PHASE       SINCE  ATTEMPTS  FAILURES  NEXT RETRY  KUBELET       LAST ERROR
example.com/gpu  DevicePlugin  Registered  1s     1         0         -           4 devices     -
example.com/nic  DevicePlugin  Registered  1s     1         0         -           NONE for 12s  kubelet holds no device of the registered resource
nfs.csi.k8s.io   CSIPlugin     Registered  1s     1         0         -           -             -
`
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
	if k := doc.Drivers[1].Kubelet; k == nil || !k.Missing || k.Devices != 0 || doc.Drivers[2].Kubelet != nil {
		t.Errorf("JSON: %+v, %+v; want nic's view missing, none for the CSI driver", doc.Drivers[1].Kubelet, doc.Drivers[2].Kubelet)
	}
}

func TestAge(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "0s", 59 * time.Second: "59s", 61 * time.Second: "61s", 4*time.Minute + 12*time.Second: "4m12s",
		3*time.Hour + 5*time.Minute: "3h5m", 50 * time.Hour: "2d2h", -time.Second: "0s", -time.Minute: "0s",
	} {
		if got := age(d); got != want {
			t.Errorf("age(%s) = %q, want %q", d, got, want)
		}
	}
}

func TestDialAddress(t *testing.T) {
	for give, want := range map[string]string{
		":9809": "127.0.0.1:9809", "0.0.0.0:9809": "127.0.0.1:9809", "[::]:9809": "127.0.0.1:9809",
		"127.0.0.1:9809": "127.0.0.1:9809", "10.1.2.3:80": "10.1.2.3:80",
	} {
		if got := dialAddress(give); got != want {
			t.Errorf("dialAddress(%q) = %q, want %q", give, got, want)
		}
	}
}

// TestDaemonObservability runs the daemon with two drivers, plays kubelet for both (accepts
// one, rejects the other), and checks what /readyz, /status, a real /metrics scrape (parsed by
// Prometheus's own text parser) and `multireg status` say, before and after the recovery and
// after a driver is removed.
func TestDaemonObservability(t *testing.T) {
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	reg := filepath.Join(dir, "reg")
	cfgText := `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: ` + reg + `
defaults: {waitForEndpoint: false, backoff: {initialInterval: 300ms, maxInterval: 300ms}}
drivers:
  - {name: good.example.com, type: DRAPlugin, endpoint: ` + filepath.Join(dir, "good.sock") + `}
  - {name: example.com/bad, type: DevicePlugin, endpoint: ` + filepath.Join(dir, "bad.sock") + `}
`
	cfg := writeConfig(t, dir, cfgText)
	// Both drivers run on this node: their endpoints are there (a driver whose endpoint is
	// not is absent, and not counted by /readyz).
	for _, ep := range []string{"good.sock", "bad.sock"} {
		l, err := net.Listen("unix", filepath.Join(dir, ep))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs testkit.Buffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"run", "--config", cfg, "--http-endpoint", "127.0.0.1:0", "--log-format", "json"}, nil, &logs, &logs)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	addrRE := regexp.MustCompile(`"msg":"serving HTTP","address":"([^"]+)"`)
	var addr string
	testkit.Eventually(t, 10*time.Second, "the HTTP address in the log", func() bool {
		m := addrRE.FindStringSubmatch(logs.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	good, bad := filepath.Join(reg, "good.example.com-reg.sock"), filepath.Join(reg, "example.com_bad-reg.sock")
	testkit.Eventually(t, 10*time.Second, "both sockets", func() bool { return fileExists(good) && fileExists(bad) })
	kubeletVerdict(t, good, true, "")
	kubeletVerdict(t, bad, false, "RegisterPlugin error -- plugin validation failed with err: no room at the inn")

	httpGet := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	testkit.Eventually(t, 10*time.Second, "/readyz to name the rejected driver and kubelet's reason", func() bool {
		code, body := httpGet("/readyz")
		return code == 503 && strings.Contains(body, "example.com/bad: BackingOff: kubelet rejected the registration: RegisterPlugin error -- plugin validation failed with err: no room at the inn")
	})
	if code, _ := httpGet("/healthz"); code != 200 {
		t.Errorf("/healthz: %d", code)
	}
	var doc statusDoc
	_, body := httpGet("/status")
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Drivers) != 2 || doc.Drivers[0].Name != "example.com/bad" || !strings.Contains(doc.Drivers[0].LastError, "no room at the inn") ||
		doc.Drivers[1].Phase != "Registered" || doc.Config.Generation != 1 || !doc.Config.LastReloadSuccessful {
		t.Errorf("status document: %+v", doc)
	}

	// A real scrape, parsed by Prometheus's text parser.
	families := scrape(t, "http://"+addr+"/metrics")
	checks := []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"multireg_driver_registered", map[string]string{"driver": "good.example.com", "type": "DRAPlugin"}, 1},
		{"multireg_driver_registered", map[string]string{"driver": "example.com/bad", "type": "DevicePlugin"}, 0},
		{"multireg_driver_phase", map[string]string{"driver": "good.example.com", "phase": "Registered"}, 1},
		{"multireg_driver_phase", map[string]string{"driver": "good.example.com", "phase": "BackingOff"}, 0},
		{"multireg_registration_attempts_total", map[string]string{"driver": "example.com/bad", "result": "rejected"}, 1},
		{"multireg_registration_attempts_total", map[string]string{"driver": "good.example.com", "result": "registered"}, 1},
		{"multireg_socket_recreations_total", map[string]string{"driver": "example.com/bad", "reason": "rejected"}, 1},
		{"multireg_endpoint_up", map[string]string{"driver": "good.example.com"}, 1},
		{"multireg_endpoint_restarts_total", map[string]string{"driver": "good.example.com"}, 0},
		{"multireg_driver_absent", map[string]string{"driver": "good.example.com"}, 0},
		{"multireg_driver_required", map[string]string{"driver": "good.example.com"}, 0},
		{"multireg_config_last_reload_successful", nil, 1},
		{"multireg_build_info", map[string]string{"version": version, "commit": commit}, 1},
	}
	for _, c := range checks {
		if got, ok := value(families, c.name, c.labels); !ok || got != c.want {
			t.Errorf("%s%v = %v (found %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	if ts, ok := value(families, "multireg_config_last_reload_success_timestamp_seconds", nil); !ok || time.Since(time.Unix(int64(ts), 0)) > time.Minute {
		t.Errorf("reload success timestamp %v (found %v), want about now", ts, ok)
	}
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes", "process_open_fds"} {
		if _, ok := families[name]; !ok {
			t.Errorf("no %s in the scrape", name)
		}
	}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if strings.Contains(l.GetValue(), "/run/") || strings.Contains(l.GetValue(), reg) {
					t.Errorf("%s has a path in a label: %s=%q", name, l.GetName(), l.GetValue())
				}
			}
		}
	}

	// `multireg status`, table and JSON.
	var out bytes.Buffer
	if err := run(context.Background(), []string{"status", "--http-endpoint", addr}, nil, &out, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"1 of 2 drivers registered", "example.com/bad", "BackingOff", "no room at the inn", "good.example.com", "Registered"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("multireg status lacks %q:\n%s", want, out.String())
		}
	}
	out.Reset()
	if err := run(context.Background(), []string{"status", "--http-endpoint", addr, "-o", "json"}, nil, &out, &out); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(out.Bytes(), &doc); err != nil || len(doc.Drivers) != 2 {
		t.Errorf("multireg status -o json: %v\n%s", err, out.String())
	}
	// The same daemon through a URL (kubectl port-forward's), as YAML.
	out.Reset()
	if err := run(context.Background(), []string{"status", "--http-endpoint", "http://" + addr, "-o", "yaml"}, nil, &out, &out); err != nil {
		t.Fatal(err)
	}
	var fromYAML statusDoc
	if err := yaml.Unmarshal(out.Bytes(), &fromYAML); err != nil || len(fromYAML.Drivers) != 2 || !strings.Contains(out.String(), "lastError: ") {
		t.Errorf("multireg status --http-endpoint http://%s -o yaml: %v\n%s", addr, err, out.String())
	}

	// The retry is accepted: everything turns green.
	// The attempt is counted just before its socket appears: wait for both.
	testkit.Eventually(t, 10*time.Second, "a new socket for the rejected driver", func() bool {
		_, body := httpGet("/status")
		fi, err := os.Lstat(bad)
		return strings.Contains(body, `"attempts": 2`) && err == nil && fi.Mode()&os.ModeSocket != 0
	})
	kubeletVerdict(t, bad, true, "")
	testkit.Eventually(t, 10*time.Second, "/readyz green", func() bool { code, _ := httpGet("/readyz"); return code == 200 })
	families = scrape(t, "http://"+addr+"/metrics")
	if got, _ := value(families, "multireg_driver_registered", map[string]string{"driver": "example.com/bad", "type": "DevicePlugin"}); got != 1 {
		t.Errorf("recovered driver registered = %v, want 1", got)
	}

	// A removed driver's series disappear.
	writeConfig(t, dir, strings.Replace(cfgText, "  - {name: example.com/bad, type: DevicePlugin, endpoint: "+filepath.Join(dir, "bad.sock")+"}\n", "", 1))
	testkit.Eventually(t, 10*time.Second, "the removed driver's series gone", func() bool {
		_, ok := value(scrape(t, "http://"+addr+"/metrics"), "multireg_driver_registered", map[string]string{"driver": "example.com/bad", "type": "DevicePlugin"})
		return !ok
	})
	if got, _ := value(scrape(t, "http://"+addr+"/metrics"), "multireg_config_generation", nil); got != 2 {
		t.Errorf("config generation %v after one reload, want 2", got)
	}
}

func TestStatusWithoutDaemon(t *testing.T) {
	err := run(context.Background(), []string{"status", "--http-endpoint", "127.0.0.1:1"}, nil, io.Discard, io.Discard)
	if err == nil || exitCode(err) != 1 || !strings.Contains(err.Error(), "no answer from the daemon at 127.0.0.1:1") {
		t.Errorf("status without a daemon: %v", err)
	}
	if err := run(context.Background(), []string{"status", "-o", "wide"}, nil, io.Discard, io.Discard); exitCode(err) != 2 {
		t.Errorf("status -o yaml: %v, want a usage error", err)
	}
}

func TestRunRefusesBusyHTTPEndpoint(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	cfg := writeConfig(t, dir, "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: "+dir+"/reg\ndrivers: []\n")
	err = run(context.Background(), []string{"run", "--config", cfg, "--http-endpoint", l.Addr().String()}, nil, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--http-endpoint") || !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("run on a busy address: %v", err)
	}
}

func fileExists(p string) bool { _, err := os.Lstat(p); return err == nil }

// kubeletVerdict plays kubelet for the socket: GetInfo, then the verdict.
func kubeletVerdict(t *testing.T, socket string, ok bool, msg string) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.GetInfo(ctx, &registerapi.InfoRequest{}); err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: ok, Error: msg}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
}

func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return families
}

// value returns the value of the metric with these labels (a subset), and whether it exists.
func value(families map[string]*dto.MetricFamily, name string, labels map[string]string) (float64, bool) {
	f, ok := families[name]
	if !ok {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		}
		return m.GetUntyped().GetValue(), true
	}
	return 0, false
}

// TestRoles: a process that does not serve the directory is healthy, ready in standby and
// idle (a surge rollout must proceed), not ready while it takes the directory, and its status
// names its role with no driver.
func TestRoles(t *testing.T) {
	for _, tt := range []struct {
		role      string
		readyCode int
	}{
		{roleStarting, 503},
		{roleStandby, 200},
		{roleIdle, 200},
	} {
		t.Run(tt.role, func(t *testing.T) {
			in := newInstance()
			in.set(tt.role, "because of a test")
			h := newHandler(in, nil)
			if code, body := get(t, h, "/healthz"); code != 200 {
				t.Errorf("/healthz: %d %s", code, body)
			}
			code, body := get(t, h, "/readyz")
			if code != tt.readyCode || !strings.Contains(body, tt.role) || !strings.Contains(body, "because of a test") {
				t.Errorf("/readyz: %d %q, want %d naming the role and why", code, body, tt.readyCode)
			}
			if code, _ := get(t, h, "/readyz/a.csi.example.com"); code != tt.readyCode {
				t.Errorf("/readyz/<driver>: %d, want %d", code, tt.readyCode)
			}
			_, body = get(t, h, "/status")
			var doc statusDoc
			if err := json.Unmarshal([]byte(body), &doc); err != nil {
				t.Fatal(err)
			}
			if doc.Instance.Role != tt.role || doc.Instance.Detail != "because of a test" || len(doc.Drivers) != 0 {
				t.Errorf("/status: %+v", doc)
			}
			var out bytes.Buffer
			printStatus(&out, doc, doc.Instance.Since.Add(3*time.Second))
			if want := "instance " + tt.role + " for 3s: because of a test\n"; out.String() != want {
				t.Errorf("table %q, want %q", out.String(), want)
			}
			if code, body := get(t, h, "/metrics"); code != 200 || !strings.Contains(body, "multireg_build_info") || strings.Contains(body, "multireg_driver_phase") {
				t.Errorf("/metrics: %d, want build info and no driver metric:\n%s", code, body)
			}
			checkRoleMetric(t, h, tt.role)
		})
	}
	in := newInstance()
	in.serve(testState(knownStates, 2), newRegistry(nil, nil, nil), "holds it")
	checkRoleMetric(t, newHandler(in, nil), roleServing)
}

// checkRoleMetric checks that /metrics has multireg_instance_role 1 for role, 0 for the others.
func checkRoleMetric(t *testing.T, h http.Handler, role string) {
	t.Helper()
	_, body := get(t, h, "/metrics")
	for _, r := range roles {
		want := 0
		if r == role {
			want = 1
		}
		if line := fmt.Sprintf("multireg_instance_role{role=%q} %d\n", r, want); !strings.Contains(body, line) {
			t.Errorf("role %s: /metrics lacks %q", role, line)
		}
	}
}

// TestStatusTableTakenOver: a serving instance that took sockets over says so first.
func TestStatusTableTakenOver(t *testing.T) {
	st := testState(knownStates[:1], 2)
	st.takenOver = func() int { return 1 }
	in := newInstance()
	in.serve(st, prometheus.NewRegistry(), "took the registration directory /reg over from the previous instance")
	var out bytes.Buffer
	printStatus(&out, newStatusDoc(in.view()), t0.Add(time.Second))
	want := "instance serving: took the registration directory /reg over from the previous instance, 1 sockets taken over\n"
	if !strings.HasPrefix(out.String(), want) {
		t.Errorf("table:\n%s\nwant it to begin with:\n%s", out.String(), want)
	}
}

// TestDescriptorsThatDoNotFit: when the drivers' sockets do not fit in RLIMIT_NOFILE, /readyz
// says so on a line of its own, /status has the numbers and the problem, and the table its
// line.
func TestDescriptorsThatDoNotFit(t *testing.T) {
	noRoom := registrar.DriverStatus{Name: "c.csi.example.com", Type: "CSIPlugin", Phase: registrar.BackingOff, Attempts: 1, Failures: 1,
		LastError: "no file descriptor left for the registration socket /reg/c-reg.sock: RLIMIT_NOFILE is 83", Since: t0}
	st := testState([]registrar.DriverStatus{knownStates[0], noRoom}, 2)
	st.descriptors = func() registrar.Descriptors {
		return registrar.Descriptors{Budget: regserver.Budget{Limit: 81, Reserved: 80, MaxSockets: 1, Sockets: 1}, Needed: 2}
	}
	h := newHandler(serving(st), nil)
	code, body := get(t, h, "/readyz")
	if code != 503 || !strings.Contains(body, "c.csi.example.com: BackingOff: no file descriptor left") ||
		!strings.Contains(body, "file descriptors: the 2 drivers need 2 registration sockets, and RLIMIT_NOFILE 81 leaves room for 1") {
		t.Errorf("GET /readyz: %d\n%s", code, body)
	}
	code, body = get(t, h, "/status")
	var doc statusDoc
	if err := json.Unmarshal([]byte(body), &doc); code != 200 || err != nil {
		t.Fatalf("GET /status: %d, %v\n%s", code, err, body)
	}
	want := descriptorsStatus{Limit: 81, Reserved: 80, MaxSockets: 1, Needed: 2, Sockets: 1, Fits: false,
		Problem: st.descriptors().Problem()}
	if doc.Descriptors == nil || *doc.Descriptors != want {
		t.Errorf("/status descriptors = %+v, want %+v", doc.Descriptors, want)
	}
	var tbl strings.Builder
	printStatus(&tbl, doc, t0)
	if !strings.Contains(tbl.String(), "NOT ENOUGH file descriptors: the 2 drivers need 2") {
		t.Errorf("the table does not say the descriptors do not fit:\n%s", tbl.String())
	}
	st.descriptors = func() registrar.Descriptors {
		return registrar.Descriptors{Budget: regserver.Budget{Limit: 1024, Reserved: 80, MaxSockets: 944}, Needed: 2}
	}
	if _, body := get(t, h, "/readyz"); strings.Contains(body, "file descriptors") {
		t.Errorf("GET /readyz names the descriptors although they fit:\n%s", body)
	}
}

// TestStatusInstanceLines: what the instance reads beside its drivers — kubelet's
// pod-resources API, the node condition and its startup taint — is printed above the table as
// `multireg status` reads it from /status, and a CSI driver's CSINode listing is its KUBELET
// cell (a driver kubelet accepted that CSINode does not list says so).
func TestStatusInstanceLines(t *testing.T) {
	csi := registrar.DriverStatus{Name: "nfs.csi.k8s.io", Type: "CSIPlugin", Phase: registrar.Registered, EndpointUp: true, Attempts: 1, Since: t0, Required: true}
	lost := csi
	lost.Name = "lost.csi.example.com"
	st := testState([]registrar.DriverStatus{lost, csi}, 2)
	st.podResources = func() (registrar.PodResources, bool) {
		return registrar.PodResources{Socket: "/var/lib/kubelet/pod-resources/kubelet.sock", DevicePluginMoves: "in place"}, true
	}
	cond := nodecond.Status{
		Type: "multireg.dev/PluginsRegistered", Node: "node-1",
		Verdict: nodecond.Verdict{Reason: nodecond.ReasonMissing, Message: "1 of 2 required plugins not held by kubelet: lost.csi.example.com (CSIPlugin): registered since 2026-11-27T05:24:57Z, not listed in the node's CSINode",
			Evidence: []nodecond.Evidence{
				{Driver: "lost.csi.example.com", Type: "CSIPlugin", Required: true, Why: "registered since 2026-11-27T05:24:57Z, not listed in the node's CSINode", NotListed: true},
				{Driver: "nfs.csi.k8s.io", Type: "CSIPlugin", Required: true, Held: true},
			}},
		OnNode:   &nodecond.Condition{Status: "True", Reason: nodecond.ReasonRegistered, Message: "kubelet holds every required plugin (2)"},
		NodeRead: true, NodeExists: true,
		CSINode:   nodecond.CSINode{Known: true, Drivers: map[string]time.Time{"nfs.csi.k8s.io": t0}},
		LastError: "write the condition on node node-1: the server is currently unable to handle the request",
		Taint:     &nodecond.Taint{Key: "multireg.dev/plugins-not-ready", Effect: "NoSchedule"},
		TaintDone: true, TaintRemoved: t0,
	}
	st.nodeCondition = func() (nodecond.Status, relay.Agent) { return cond, relay.Agent{Running: true, Starts: 1} }
	doc := newStatusDoc(serving(st).view())
	var out bytes.Buffer
	printStatus(&out, doc, t0.Add(time.Second))
	want := `config /etc/multireg/config.yaml (generation 3): applied
kubelet's pod-resources API /var/lib/kubelet/pod-resources/kubelet.sock: DOES NOT ANSWER: no device plugin's resource is shown, no move verified; device-plugin moves: in place
node condition multireg.dev/PluginsRegistered on node node-1: False (RequiredPluginsMissing: 1 of 2 required plugins not held by kubelet: lost.csi.example.com (CSIPlugin): registered since 2026-11-27T05:24:57Z, not listed in the node's CSINode); NOT ON THE NODE YET, which shows True (RequiredPluginsRegistered) (write the condition on node node-1: the server is currently unable to handle the request); startup taint multireg.dev/plugins-not-ready:NoSchedule removed 1s ago
2 of 2 drivers registered

DRIVER                TYPE       PHASE       SINCE  ATTEMPTS  FAILURES  NEXT RETRY  KUBELET         LAST ERROR
lost.csi.example.com  CSIPlugin  Registered  1s     1         0         -           NOT IN CSINODE  kubelet accepted the driver and the node's CSINode does not list it
nfs.csi.k8s.io        CSIPlugin  Registered  1s     1         0         -           in CSINode      -
`
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
	if h := doc.Drivers[0].Held; h == nil || h.Held || !strings.Contains(h.Why, "not listed") {
		t.Errorf("JSON: the lost driver held %+v", h)
	}
	if c := doc.Drivers[1].CSINode; c == nil || !c.Listed || c.Since == nil {
		t.Errorf("JSON: the listed driver's CSINode %+v", c)
	}
}
