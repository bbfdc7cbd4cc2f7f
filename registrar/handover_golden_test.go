package registrar

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

// goldenV1 is internal/handover's golden file of hand-over protocol version 1: v0.1.0's own
// messages, its batch among them.
const goldenV1 = "../internal/handover/testdata/v0.1.0/protocol-v1.json"

// goldenRoot is the directory the golden file's paths are under.
const goldenRoot = "/node"

// v010Batch is v0.1.0's batch of goldenV1 made this test's: its paths under dir instead of
// goldenRoot, each socket listening there (the descriptors returned, in the batch's order) with
// its identity, each endpoint served (but a driver's without a socket: absent from the node)
// with its identity, and the keys of loopPolicy left out of each driver's configuration. It
// returns the batch's JSON and the drivers' names by type.
func v010Batch(t *testing.T, dir string, loopPolicy []string) ([]byte, []*os.File, map[string]string) {
	t.Helper()
	b, err := os.ReadFile(goldenV1)
	if err != nil {
		t.Fatal(err)
	}
	b = []byte(strings.ReplaceAll(string(b), `"`+goldenRoot+`/`, `"`+dir+`/`))
	var msgs []struct {
		From string         `json:"from"`
		Msg  map[string]any `json:"msg"`
	}
	if err := json.Unmarshal(b, &msgs); err != nil {
		t.Fatal(err)
	}
	var batch map[string]any
	for _, m := range msgs {
		if m.Msg["type"] == handover.MsgBatch {
			batch = m.Msg
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "reg"), 0o750); err != nil {
		t.Fatal(err)
	}
	wireID := func(path string) map[string]any {
		id := mustID(t, path)
		sec, nsec := id.Ctime.Unix()
		return map[string]any{"dev": id.Dev, "ino": id.Ino, "ctimeSec": sec, "ctimeNsec": nsec}
	}
	var files []*os.File
	names := map[string]string{}
	for _, x := range batch["drivers"].([]any) {
		d := x.(map[string]any)
		spec := d["spec"].(map[string]any)
		names[spec["Name"].(string)] = spec["Type"].(string)
		for _, k := range loopPolicy {
			delete(spec, k)
		}
		sockets, _ := d["sockets"].([]any)
		if len(sockets) == 0 {
			continue
		}
		csiName := ""
		if spec["Type"] == config.CSIPlugin {
			csiName = spec["Name"].(string)
		}
		startEndpoint(t, d["localEndpoint"].(string), csiName)
		d["endpointID"] = wireID(d["localEndpoint"].(string))
		for _, y := range sockets {
			s := y.(map[string]any)
			l, err := testkit.ListenUnlinked(s["path"].(string))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			f, err := l.File()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			files = append(files, f)
			s["id"] = wireID(s["path"].(string))
		}
	}
	out, err := json.Marshal(batch)
	if err != nil {
		t.Fatal(err)
	}
	return out, files, names
}

// holdRaw plays a holder of reg that speaks only version 1, as v0.1.0 does: it holds the
// directory's lock, answers one hand-over request with batch (its JSON as given), the
// descriptors files and the lock's, and says released once acknowledged, letting go of the
// lock. The channel says what the new instance answered.
func holdRaw(t *testing.T, reg string, batch []byte, files []*os.File) <-chan string {
	t.Helper()
	lock, err := os.OpenFile(filepath.Join(reg, regdir.LockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	l, err := handover.Listen(reg)
	if err != nil {
		t.Fatal(err)
	}
	answer := make(chan string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		defer lock.Close()
		c, err := l.AcceptUnix()
		if err != nil {
			answer <- err.Error()
			return
		}
		defer c.Close()
		buf := make([]byte, 4096)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, _, _, _, err := c.ReadMsgUnix(buf, nil); err != nil { // the hello
			answer <- err.Error()
			return
		}
		var fds []int
		for _, f := range append(files, lock) {
			fds = append(fds, int(f.Fd()))
		}
		if _, _, err := c.WriteMsgUnix(batch, syscall.UnixRights(fds...), nil); err != nil {
			answer <- err.Error()
			return
		}
		n, _, _, _, err := c.ReadMsgUnix(buf, nil)
		if err != nil {
			answer <- err.Error()
			return
		}
		var m handover.Msg
		json.Unmarshal(buf[:n], &m)
		answer <- m.Type
		if m.Type == handover.MsgAck {
			lock.Close()
			c.Write([]byte(`{"type":"released","version":1}`))
		}
	}()
	return answer
}

// TestHandOverFromV010: v0.1.0's batch (internal/handover's golden file of protocol version 1,
// as v0.1.0 sent it; its paths and file identities this test's) is taken over with no
// re-registration by an instance whose configuration registers every driver as v0.1.0 did,
// with another loop policy (backoff, registrationTimeout, waitForEndpoint, required) — also
// when the batch leaves the loop policy out, as an older release's does once a field is added.
// Each socket handed over is served as it was (the same file), each driver Registered from
// the start; the driver absent from the node waits for its endpoint.
func TestHandOverFromV010(t *testing.T) {
	for _, tt := range []struct {
		name    string
		without []string
	}{
		{"as v0.1.0 sent it", nil},
		{"without loop policy", []string{"Backoff", "RegistrationTimeout", "WaitForEndpoint", "Required"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			reg := filepath.Join(dir, "reg")
			batch, files, names := v010Batch(t, dir, tt.without)
			var ds []config.Driver
			for name, typ := range names {
				d := testDriver(dir, name, typ, filepath.Join(dir, "ep", strings.ReplaceAll(name, "/", "_")+".sock"))
				d.RegistrationTimeout, d.Required = time.Hour, true // v0.1.0's: 2m, not required
				ds = append(ds, d)
			}
			before := map[string]fsid.ID{}
			for _, d := range ds {
				if testkit.IsSocket(d.SocketPath) {
					before[d.Name] = mustID(t, d.SocketPath)
				}
			}
			if len(before) != 3 {
				t.Fatalf("%d sockets handed over, want 3: %v", len(before), before)
			}
			answer := holdRaw(t, reg, batch, files)
			in := startMultireg(t, reg, ds)
			if a := <-answer; a != handover.MsgAck {
				t.Fatalf("the new instance answered %q", a)
			}
			if in.handed != len(ds) || in.sup.TakenOver() != len(before) {
				t.Fatalf("%d drivers received, %d sockets served; want %d and %d", in.handed, in.sup.TakenOver(), len(ds), len(before))
			}
			registered := func() bool {
				for _, d := range ds {
					st := statusOf(in.sup, d.Name)
					if id, ok := before[d.Name]; ok && (st.Phase != Registered || mustID(t, d.SocketPath) != id) {
						return false
					}
				}
				return true
			}
			if !registered() {
				t.Fatal("a driver handed over registered is not Registered on its socket")
			}
			testkit.Never(t, time.Second, "a driver to register again", func() bool { return !registered() })
			for _, d := range ds {
				if _, ok := before[d.Name]; !ok {
					if st := statusOf(in.sup, d.Name); st.Phase != WaitingForEndpoint || !st.Absent {
						t.Errorf("%s: %s (absent %v), want WaitingForEndpoint, absent", d.Name, st.Phase, st.Absent)
					}
				}
			}
		})
	}
}

// notHanded are the fields of DriverStatus a hand-over does not carry: the receiver's own
// configuration says them (name, type, display, endpoint, required), or the receiver looks
// anew (kubelet's view, the paths in the way, since when the endpoint has been up or down:
// from its first look).
var notHanded = []string{"Name", "Type", "Display", "Endpoint", "Required", "Kubelet", "InTheWay", "EndpointSince"}

// TestStatusOnTheWire: every field of DriverStatus is carried by a hand-over (handover.Status,
// on the wire as internal/handover says) or listed in notHanded; a field added to DriverStatus
// fails here until it is either. A status handed over comes back as it was, but for what the
// receiver's configuration says.
func TestStatusOnTheWire(t *testing.T) {
	st := reflect.TypeFor[DriverStatus]()
	wire := reflect.TypeFor[handover.Status]()
	for i := range st.NumField() {
		f := st.Field(i)
		if _, ok := wire.FieldByName(f.Name); !ok && !slices.Contains(notHanded, f.Name) {
			t.Errorf("DriverStatus.%s is not handed over: carry it in handover.Status (a new protocol version) or list it in notHanded", f.Name)
		}
	}
	at := time.Date(2026, 11, 27, 5, 24, 57, 0, time.UTC)
	full := DriverStatus{
		Name: "a.example.com", Type: config.CSIPlugin, Phase: BackingOff, Socket: "/reg/a-reg.sock", Endpoint: "/ep/a.sock",
		EndpointUp: true, Absent: true, Required: true, Attempts: 3, Failures: 2,
		Results: map[string]int{ResultRejected: 2}, Recreations: map[string]int{ReasonRejected: 2}, EndpointRestarts: 1,
		HeldByOther: true, LastError: "no", Since: at, NextAttempt: at.Add(time.Second), Kubelet: &KubeletView{Devices: 1},
	}
	if z := slices.DeleteFunc(zeroFields(reflect.ValueOf(full)), func(f string) bool { return slices.Contains(notHanded, f) }); len(z) > 0 {
		t.Fatalf("the test's status leaves %v zero: set them in full here, so that the round trip checks them", z)
	}
	b, err := json.Marshal(&handover.Driver{Spec: config.Driver{Registration: config.Registration{Name: full.Name}}, Status: handedStatus(full)})
	if err != nil {
		t.Fatal(err)
	}
	var back handover.Driver
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	d := newDriver(config.Driver{Registration: config.Registration{Name: "b.example.com", Type: config.DevicePlugin, Endpoint: "/ep/b.sock"}}, testkit.Logger(t), nil)
	got := d.takenStatus(back.Status)
	want := full
	want.Name, want.Type, want.Endpoint, want.Required, want.Kubelet = "b.example.com", config.DevicePlugin, "/ep/b.sock", false, nil
	want.Display = config.Display{} // the receiver's
	if !reflect.DeepEqual(got, want) {
		t.Errorf("status after the hand-over:\n%+v\nwant\n%+v", got, want)
	}
}

// zeroFields lists the fields of the struct v that are zero.
func zeroFields(v reflect.Value) []string {
	var out []string
	for i := range v.NumField() {
		if v.Field(i).IsZero() {
			out = append(out, v.Type().Field(i).Name)
		}
	}
	return out
}
