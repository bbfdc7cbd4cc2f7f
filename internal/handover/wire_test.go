package handover

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
)

// update rewrites this build's golden files (testdata/HEAD) from goldenExchange, values only:
// a new shape is a new version.
var update = flag.Bool("update", false, "rewrite testdata/HEAD/protocol-v<N>.json (values only)")

// The releases whose messages testdata holds: this build's (head), and v0.1.0's, as v0.1.0
// wrote them (e2e/registration's TestHandoverGoldenV010 records them).
const (
	head = "HEAD"
	v010 = "v0.1.0"
)

// goldenFile is the golden file of protocol version v as release writes it.
func goldenFile(release string, v int) string {
	return filepath.Join("testdata", release, fmt.Sprintf("protocol-v%d.json", v))
}

// golden is a golden file: a release, and a protocol version it speaks.
type golden struct {
	release string
	version int
}

func (g golden) String() string { return fmt.Sprintf("%s version %d", g.release, g.version) }

// goldens are every golden file: what older releases wrote, and what this build writes in each
// version it speaks.
func goldens() []golden {
	gs := []golden{{v010, 1}}
	for v := minVersion; v <= maxVersion; v++ {
		gs = append(gs, golden{head, v})
	}
	return gs
}

// exchanged is one message of a golden file: who sent it, and the message.
type exchanged struct {
	From string          `json:"from"` // holder or new
	Msg  json.RawMessage `json:"msg"`
}

// readGolden reads the golden file of version v as release writes it.
func readGolden(t *testing.T, release string, v int) []exchanged {
	t.Helper()
	b, err := os.ReadFile(goldenFile(release, v))
	if err != nil {
		t.Fatal(err)
	}
	var msgs []exchanged
	if err := json.Unmarshal(b, &msgs); err != nil {
		t.Fatal(err)
	}
	return msgs
}

// fullDriver is a driver of the current build with every field of its wire set: no field is
// zero on the wire (TestGoldenFixtureIsFull), so that every field is in the golden file.
func fullDriver() *Driver {
	at := time.Date(2026, 11, 27, 5, 24, 57, 123456789, time.UTC)
	id := func(ino uint64) fsid.ID {
		return fsid.ID{Dev: 65024, Ino: ino, Ctime: syscall.NsecToTimespec(at.UnixNano() + int64(ino))}
	}
	return &Driver{
		Spec: config.Driver{
			Registration: config.Registration{
				Name:              "gpu.example.com",
				Type:              config.DRAPlugin,
				Endpoint:          "/var/lib/kubelet/plugins/gpu.example.com/dra-*.sock",
				SupportedVersions: []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"},
				SocketName:        "gpu.example.com-reg.sock",
				SocketPath:        "/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock",
				AltSocketPath:     "/var/lib/kubelet/plugins_registry/gpu.example.com-reg-2.sock",
			},
			Local: config.Local{LocalEndpoint: "/host/plugins/gpu.example.com/dra-*.sock"},
			Policy: config.Policy{
				Backoff:             config.Backoff{InitialInterval: time.Second, MaxInterval: 2 * time.Minute, Multiplier: 2, RandomizationFactor: 0.2},
				RegistrationTimeout: 2 * time.Minute,
				WaitForEndpoint:     true,
				Required:            true,
			},
		},
		Endpoint:      "/var/lib/kubelet/plugins/gpu.example.com/dra-2.sock",
		LocalEndpoint: "/host/plugins/gpu.example.com/dra-2.sock",
		EndpointID:    id(101),
		NodeInfo:      []byte("\n\x04node"),
		Status: Status{
			Phase:            "Serving",
			Socket:           "/var/lib/kubelet/plugins_registry/gpu.example.com-reg-2.sock",
			EndpointUp:       true,
			Absent:           true,
			Attempts:         3,
			Failures:         1,
			Results:          map[string]int{"registered": 1, "rejected": 1},
			Recreations:      map[string]int{"rejected": 1},
			EndpointRestarts: 1,
			HeldByOther:      true,
			LastError:        "kubelet rejected the registration: no",
			Since:            at,
			NextAttempt:      at.Add(2 * time.Second),
		},
		Timeout:  4 * time.Minute,
		Failures: 1,
		Sockets: []*Socket{{
			Prev:          true,
			Path:          "/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock",
			ID:            id(102),
			Generation:    3,
			Registered:    true,
			AwaitsVerdict: true,
			Endpoint:      "/var/lib/kubelet/plugins/gpu.example.com/dra-1.sock",
			LocalEndpoint: "/host/plugins/gpu.example.com/dra-1.sock",
			Versions:      []string{"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"},
		}, {
			Path:          "/var/lib/kubelet/plugins_registry/gpu.example.com-reg-2.sock",
			ID:            id(103),
			Generation:    4,
			Endpoint:      "/var/lib/kubelet/plugins/gpu.example.com/dra-2.sock",
			LocalEndpoint: "/host/plugins/gpu.example.com/dra-2.sock",
			Versions:      []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"},
		}},
	}
}

// goldenExchange is every message of version v as this build writes it: a hand-over, a
// refusal and an abort (version 1 has no welcome and no take).
func goldenExchange(t *testing.T, v int) []byte {
	t.Helper()
	d := fullDriver()
	var listeners, taken []ListenerSpec // version 2 on: the old instance's, and those the new one took
	if v >= listenersVersion {
		listeners = []ListenerSpec{{Name: "http", Addr: ":9809"}, {Name: "health-http", Addr: ":9810"}}
		taken = listeners[:1]
	}
	msgs := []struct {
		from string
		m    *Msg
	}{
		{"new", &Msg{Type: MsgHello, MinVersion: minVersion, Version: v}},
		{"holder", &Msg{Type: MsgRefuse, Reason: "another hand-over is in progress"}},
		{"holder", &Msg{Type: MsgWelcome, Version: v}},
		{"new", &Msg{Type: MsgTake, Version: v}},
		{"holder", &Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{d}, Sockets: len(d.Sockets), Last: true, Lock: true, Listeners: listeners}},
		{"new", &Msg{Type: MsgAbort, Reason: "batch: 1 descriptors for 2 sockets"}},
		{"new", &Msg{Type: MsgAck, Version: v, Listeners: taken}},
		{"holder", &Msg{Type: MsgReleased, Version: v}},
	}
	var out []exchanged
	for _, x := range msgs {
		if v < takeVersion && (x.m.Type == MsgWelcome || x.m.Type == MsgTake) {
			continue
		}
		b, err := json.Marshal(x.m)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, exchanged{From: x.from, Msg: b})
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return append(b, '\n')
}

// dataMaps are the keys of objects whose own keys are data, not the format's: a status's
// counters, by result and by reason. Their shape is that they are objects.
var dataMaps = []string{"Results", "Recreations"}

// shape lists the keys of every object in a golden file's messages, by sender, message type
// and path (the elements of an array together), and the JSON type of every value: what a
// peer of the version reads.
func shape(t *testing.T, b []byte) []string {
	t.Helper()
	var msgs []struct {
		From string         `json:"from"`
		Msg  map[string]any `json:"msg"`
	}
	if err := json.Unmarshal(b, &msgs); err != nil {
		t.Fatal(err)
	}
	var out []string
	var walk func(path, key string, v any)
	walk = func(path, key string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if slices.Contains(dataMaps, key) {
				out = append(out, path+":object")
				return
			}
			for k, x := range v {
				walk(path+"."+k, k, x)
			}
		case []any:
			for _, x := range v {
				walk(path+"[]", key, x)
			}
		default:
			out = append(out, fmt.Sprintf("%s:%T", path, v))
		}
	}
	for _, m := range msgs {
		walk(fmt.Sprintf("%s:%v", m.From, m.Msg["type"]), "", m.Msg)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// TestGoldenOfThisBuild: what this build writes in each version it speaks is that version's
// golden file in testdata/HEAD. -update rewrites the files, values only: a change of their keys
// or of their types is what a peer of that version would misread, and needs a new version (a
// new golden file, which -update then writes), while the files of the versions there are stay
// as they are.
func TestGoldenOfThisBuild(t *testing.T) {
	for v := minVersion; v <= maxVersion; v++ {
		t.Run(fmt.Sprint("version ", v), func(t *testing.T) {
			file := goldenFile(head, v)
			got := goldenExchange(t, v)
			want, err := os.ReadFile(file)
			if err != nil && !(os.IsNotExist(err) && *update) {
				t.Fatal(err)
			}
			if want != nil {
				if g, w := shape(t, got), shape(t, want); !slices.Equal(g, w) {
					t.Fatalf("the messages of protocol version %d changed shape, which a peer of that version would misread: "+
						"keep version %d as it is, add version %d (maxVersion) with an encoder of its own, and write its golden file with -update.\n"+
						"written now, not in %s: %v\nin it, not written now: %v",
						v, v, maxVersion+1, file, missing(g, w), missing(w, g))
				}
			}
			if *update {
				if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(file, got, 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if !bytes.Equal(got, want) {
				t.Errorf("this build writes protocol version %d otherwise than %s (go test -update rewrites it):\n%s", v, file, got)
			}
		})
	}
}

// missing lists what a holds and b does not.
func missing(a, b []string) []string {
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	return out
}

// v010Unrecorded is what v0.1.0 writes in version 1 that its recording (testdata/v0.1.0) lacks:
// the refusal and the abort, which the recorded hand-over did not need, and a socket's keys
// that v0.1.0 leaves out when false (no recorded socket was a previous one, or awaited a
// verdict).
var v010Unrecorded = []string{
	"holder:refuse.type:string",
	"holder:refuse.reason:string",
	"new:abort.type:string",
	"new:abort.reason:string",
	"holder:batch.drivers[].sockets[].prev:bool",
	"holder:batch.drivers[].sockets[].awaitsVerdict:bool",
}

// TestVersion1IsV010s: what this build writes in version 1 has the shape of what v0.1.0 wrote
// (testdata/v0.1.0): every key v0.1.0 wrote, with its JSON type, and no other but those its
// recording lacks (v010Unrecorded). And every message of v0.1.0's, read by this build and
// written again in its version, is v0.1.0's message, key for key and value for value: a v0.1.0
// peer reads from this build what it reads from itself.
func TestVersion1IsV010s(t *testing.T) {
	ours, theirs := shape(t, goldenExchange(t, 1)), shape(t, mustMarshal(t, readGolden(t, v010, 1)))
	if m := missing(theirs, ours); len(m) > 0 {
		t.Errorf("keys v0.1.0 writes in version 1 that this build does not: %v", m)
	}
	if m := missing(missing(ours, theirs), v010Unrecorded); len(m) > 0 {
		t.Errorf("keys this build writes in version 1 that v0.1.0 does not: %v", m)
	}
	if m := missing(v010Unrecorded, ours); len(m) > 0 {
		t.Errorf("keys of v010Unrecorded this build does not write in version 1: %v", m)
	}

	for _, x := range readGolden(t, v010, 1) {
		var m Msg
		if err := json.Unmarshal(x.Msg, &m); err != nil {
			t.Fatal(err)
		}
		again, err := json.Marshal(&m)
		if err != nil {
			t.Fatal(err)
		}
		var want, got any
		if err := json.Unmarshal(x.Msg, &want); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(again, &got); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("v0.1.0's %s, read and written again:\n%s\nwant\n%s", m.Type, again, x.Msg)
		}
	}
}

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestGoldenFixtureIsFull: the driver of the golden files sets every field of each version's
// wire, so that a field added to it changes that version's golden file (TestGoldenOfThisBuild).
func TestGoldenFixtureIsFull(t *testing.T) {
	for v, w := range map[int]any{1: fullDriver().wireV1(), 2: fullDriver().wireV2()} {
		var zero []string
		var walk func(path string, v reflect.Value)
		walk = func(path string, v reflect.Value) {
			if v.IsZero() {
				zero = append(zero, path)
				return
			}
			switch v.Kind() {
			case reflect.Pointer:
				walk(path, v.Elem())
			case reflect.Struct:
				if v.Type() == reflect.TypeFor[time.Time]() {
					return
				}
				for i := range v.NumField() {
					walk(path+"."+v.Type().Field(i).Name, v.Field(i))
				}
			case reflect.Slice:
				for i := range v.Len() {
					walk(fmt.Sprintf("%s[%d]", path, i), v.Index(i))
				}
			}
		}
		walk("driver", reflect.ValueOf(w))
		// One of the two sockets is the previous one, and only one awaits a verdict.
		zero = slices.DeleteFunc(zero, func(p string) bool {
			return p == "driver.Sockets[1].Prev" || p == "driver.Sockets[1].AwaitsVerdict" || p == "driver.Sockets[1].Registered"
		})
		if len(zero) > 0 {
			t.Errorf("fields of version %d's wire the golden file's driver leaves zero: %v", v, zero)
		}
	}
}

// goldenDrivers are the drivers of the batches of golden file g, as this build reads them.
func goldenDrivers(t *testing.T, g golden) []*Driver {
	t.Helper()
	var drivers []*Driver
	for _, x := range readGolden(t, g.release, g.version) {
		var m Msg
		if err := json.Unmarshal(x.Msg, &m); err != nil {
			t.Fatalf("%s: %s: %v", g, x.Msg, err)
		}
		drivers = append(drivers, m.Drivers...)
	}
	return drivers
}

// TestGoldenFilesDecode: every golden file (v0.1.0's, and this build's of each version it
// speaks) is read by this build: every message, each driver with its configuration, its status
// and its sockets. v0.1.0's is four drivers, three of them registered on a socket each.
func TestGoldenFilesDecode(t *testing.T) {
	for _, g := range goldens() {
		t.Run(g.String(), func(t *testing.T) {
			for _, x := range readGolden(t, g.release, g.version) {
				var m Msg
				if err := json.Unmarshal(x.Msg, &m); err != nil {
					t.Fatalf("%s: %v", x.Msg, err)
				}
				if m.Type != MsgHello && m.Type != MsgRefuse && m.Type != MsgAbort && m.Version != g.version {
					t.Errorf("a %s in version %d in the golden file of version %d", m.Type, m.Version, g.version)
				}
				if (m.Type == MsgWelcome || m.Type == MsgTake) && g.version < takeVersion {
					t.Errorf("a %s in version %d, which has none", m.Type, g.version)
				}
				if m.Type == MsgBatch {
					n := 0
					for _, d := range m.Drivers {
						n += len(d.Sockets)
					}
					if n != m.Sockets || !m.Last || !m.Lock {
						t.Errorf("a batch of %d sockets that says %d (last %v, lock %v)", n, m.Sockets, m.Last, m.Lock)
					}
				}
			}
			drivers := goldenDrivers(t, g)
			for _, d := range drivers {
				if !slices.Equal(d.unsent, unsent{"SparePath"}) || d.Spec.Name == "" || d.Spec.SocketPath == "" || len(d.Spec.SupportedVersions) == 0 {
					t.Errorf("%s: a configuration read as %+v (unsent %v)", d.Spec.Name, d.Spec, d.unsent)
				}
				if d.Status.Phase == "" || d.Status.Since.IsZero() || d.Status.Results == nil {
					t.Errorf("%s: a status read as %+v", d.Spec.Name, d.Status)
				}
				for _, s := range d.Sockets {
					if s.Path == "" || s.ID.Ino == 0 || s.Generation == 0 || len(s.Versions) == 0 {
						t.Errorf("%s: a socket read as %+v", d.Spec.Name, s)
					}
				}
			}
			if g.release != v010 {
				return
			}
			registered := 0
			for _, d := range drivers {
				if len(d.Sockets) == 1 && d.Sockets[0].Registered && d.Status.Phase == "Registered" {
					registered++
				}
			}
			if len(drivers) != 4 || registered != 3 {
				t.Errorf("v0.1.0's batch read as %d drivers, %d registered on a socket; want 4 and 3", len(drivers), registered)
			}
		})
	}
}

// received is d as a receiver holds it after the wire: no descriptor, and SparePath not sent
// (the receiver's own).
func received(d *Driver) *Driver {
	r := *d
	r.Sockets = nil
	for _, s := range d.Sockets {
		c := *s
		c.File, c.Own = nil, false
		r.Sockets = append(r.Sockets, &c)
	}
	r.Spec.SparePath, r.Spec.Display = "", config.Display{}
	r.unsent = unsent{"SparePath"}
	return &r
}

// TestGoldenFilesReadAsTheSameDriver: the receiver reads the same driver from each golden file
// whichever version wrote it. This build's files of every version read as the driver they were
// written from (fullDriver); each driver of v0.1.0's file reads the same written again by this
// build in every version.
func TestGoldenFilesReadAsTheSameDriver(t *testing.T) {
	want := received(fullDriver())
	for v := minVersion; v <= maxVersion; v++ {
		ds := goldenDrivers(t, golden{head, v})
		if len(ds) != 1 || !reflect.DeepEqual(ds[0], want) {
			t.Errorf("testdata/HEAD's version %d read as %+v\nwant %+v", v, ds, want)
		}
	}
	for _, d := range goldenDrivers(t, golden{v010, 1}) {
		for v := minVersion; v <= maxVersion; v++ {
			b := mustMarshal(t, &Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{d}})
			var m Msg
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatal(err)
			}
			if len(m.Drivers) != 1 || !reflect.DeepEqual(m.Drivers[0], d) {
				t.Errorf("%s of v0.1.0's batch, written in version %d, read as %+v\nwant %+v", d.Spec.Name, v, m.Drivers, d)
			}
		}
	}
}

// TestMessagesInTheirVersion: a message's drivers are written by its version's encoder, as that
// version's wire type has them (version 1's status says the driver's name, version 2's does
// not), and a batch of drivers in a version this build does not write is an error, not another
// version's layout. A message without drivers is written in any version. A driver alone is
// written as the newest version writes it.
func TestMessagesInTheirVersion(t *testing.T) {
	d := fullDriver()
	wireOf := map[int]reflect.Type{1: reflect.TypeFor[wireDriverV1](), 2: reflect.TypeFor[wireDriverV2]()}
	for v := minVersion; v <= maxVersion; v++ {
		typ, ok := wireOf[v]
		if !ok {
			t.Fatalf("version %d has no wire type in this test", v)
		}
		var m struct {
			Drivers []struct {
				Spec   map[string]any `json:"spec"`
				Status map[string]any `json:"status"`
			} `json:"drivers"`
		}
		if err := json.Unmarshal(mustMarshal(t, &Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{d}}), &m); err != nil {
			t.Fatal(err)
		}
		for part, written := range map[string]map[string]any{"Spec": m.Drivers[0].Spec, "Status": m.Drivers[0].Status} {
			f, _ := typ.FieldByName(part)
			if got, want := slices.Sorted(maps.Keys(written)), jsonKeys(f.Type); !slices.Equal(got, want) {
				t.Errorf("version %d: a driver's %s written with the keys %v, want %v", v, part, got, want)
			}
		}
		if _, named := m.Drivers[0].Status["Name"]; named != (v == 1) {
			t.Errorf("version %d: the status names the driver: %v", v, named)
		}
	}
	for _, v := range []int{0, maxVersion + 1} {
		if b, err := json.Marshal(&Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{d}}); err == nil {
			t.Errorf("a batch in version %d written as %s", v, b)
		}
		if _, err := json.Marshal(&Msg{Type: MsgBatch, Version: v, Last: true, Lock: true}); err != nil {
			t.Errorf("an empty batch in version %d: %v", v, err)
		}
	}
	// A driver whose loop has no target yet, and no counters: version 1's status shows the
	// configured endpoint, and empty counters, as v0.1.0's did.
	fresh := &Driver{Spec: d.Spec}
	var m1 struct {
		Drivers []struct {
			Status map[string]any `json:"status"`
		} `json:"drivers"`
	}
	if err := json.Unmarshal(mustMarshal(t, &Msg{Type: MsgBatch, Version: 1, Drivers: []*Driver{fresh}}), &m1); err != nil {
		t.Fatal(err)
	}
	if st := m1.Drivers[0].Status; st["Endpoint"] != d.Spec.Endpoint || fmt.Sprint(st["Results"], st["Recreations"]) != "map[] map[]" {
		t.Errorf("version 1: a fresh driver's status written as %v", st)
	}
	alone := mustMarshal(t, d)
	var m struct {
		Drivers []json.RawMessage `json:"drivers"`
	}
	json.Unmarshal(mustMarshal(t, &Msg{Type: MsgBatch, Version: maxVersion, Drivers: []*Driver{d}}), &m)
	if !bytes.Equal(alone, m.Drivers[0]) {
		t.Errorf("a driver alone written as %s, not as version %d does: %s", alone, maxVersion, m.Drivers[0])
	}
}

// jsonKeys are the keys of struct type typ on the wire.
func jsonKeys(typ reflect.Type) []string {
	var keys []string
	for i := range typ.NumField() {
		keys = append(keys, strings.Split(typ.Field(i).Tag.Get("json"), ",")[0])
	}
	slices.Sort(keys)
	return keys
}

// v010Drivers are the drivers of v0.1.0's golden file, as v0.1.0 sent them (JSON objects),
// and as this build reads them.
func v010Drivers(t *testing.T) ([]map[string]any, []*Driver) {
	t.Helper()
	var raw []map[string]any
	var read []*Driver
	for _, x := range readGolden(t, v010, 1) {
		var m struct {
			Type    string            `json:"type"`
			Drivers []json.RawMessage `json:"drivers"`
		}
		if err := json.Unmarshal(x.Msg, &m); err != nil {
			t.Fatal(err)
		}
		for _, b := range m.Drivers {
			var obj map[string]any
			var d Driver
			if err := json.Unmarshal(b, &obj); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &d); err != nil {
				t.Fatal(err)
			}
			raw, read = append(raw, obj), append(read, &d)
		}
	}
	return raw, read
}

// loopPolicy are the keys of a driver's configuration on the wire that only its loop reads,
// and where this process reaches its endpoint: never what kubelet sees.
var loopPolicy = []string{"Backoff", "RegistrationTimeout", "WaitForEndpoint", "Required", "LocalEndpoint"}

// TestV010TakenOverAsItRegistered: each driver v0.1.0 handed over (its golden file)
// registers as this instance's configuration of it does when the two agree on what kubelet
// sees — whatever their loop policy, and when the batch has no loop policy at all (as an
// older release's, once a field is added) — and does not when they differ in any of it.
func TestV010TakenOverAsItRegistered(t *testing.T) {
	raw, read := v010Drivers(t)
	for i, d := range read {
		// This instance's configuration: what v0.1.0 ran (config.Driver's field names are the
		// keys it sent), with another loop policy.
		b, err := json.Marshal(raw[i]["spec"])
		if err != nil {
			t.Fatal(err)
		}
		var own config.Driver
		if err := json.Unmarshal(b, &own); err != nil {
			t.Fatal(err)
		}
		own.Backoff = config.Backoff{InitialInterval: 3 * time.Second, MaxInterval: time.Hour, Multiplier: 3}
		own.RegistrationTimeout, own.WaitForEndpoint, own.Required = 0, !own.WaitForEndpoint, !own.Required
		own.LocalEndpoint = "/host" + own.LocalEndpoint
		if !d.RegistersAs(own) {
			t.Errorf("%s: registers otherwise than v0.1.0 did, with only the loop policy changed", own.Name)
		}

		// The same batch without its loop policy.
		spec := raw[i]["spec"].(map[string]any)
		for _, k := range loopPolicy {
			delete(spec, k)
		}
		b, err = json.Marshal(raw[i])
		if err != nil {
			t.Fatal(err)
		}
		var bare Driver
		if err := json.Unmarshal(b, &bare); err != nil {
			t.Fatal(err)
		}
		if !bare.RegistersAs(own) {
			t.Errorf("%s: registers otherwise than v0.1.0 did, from a batch without loop policy", own.Name)
		}
		if bare.Spec.Backoff != (config.Backoff{}) || bare.Spec.RegistrationTimeout != 0 {
			t.Errorf("%s: loop policy %+v read from a batch without it", own.Name, bare.Spec)
		}

		// Anything kubelet sees, changed. (A second registration path follows from the rest:
		// the receiver's own counts, so that a release giving a driver one hands over alike.)
		for _, change := range []func(*config.Driver){
			func(c *config.Driver) { c.Type += "Other" },
			func(c *config.Driver) { c.Endpoint += ".new" },
			func(c *config.Driver) { c.SupportedVersions = append(slices.Clone(c.SupportedVersions), "v9") },
			func(c *config.Driver) { c.SocketPath += ".new" },
		} {
			other := own
			change(&other)
			if d.RegistersAs(other) || bare.RegistersAs(other) {
				t.Errorf("%s: registers as %+v", own.Name, other)
			}
		}
	}
}

// leaf is a field of config.Driver inside its group (config.go).
type leaf struct {
	group string
	field reflect.StructField
	index []int // in config.Driver
}

// leaves are the fields of config.Driver, group by group.
func leaves() []leaf {
	var ls []leaf
	typ := reflect.TypeFor[config.Driver]()
	for i := range typ.NumField() {
		g := typ.Field(i)
		for j := range g.Type.NumField() {
			ls = append(ls, leaf{group: g.Name, field: g.Type.Field(j), index: []int{i, j}})
		}
	}
	return ls
}

// specOf is each version's spec on the wire.
var specOf = map[int]reflect.Type{1: reflect.TypeFor[wireSpecV1](), 2: reflect.TypeFor[wireSpecV2]()}

// TestSpecOnTheWire: every field of config.Driver's groups that a peer needs is on the wire of
// the newest version under its own name (the key v0.1.0 sent): a field added to a group fails
// here until it is carried (a new protocol version, TestGoldenOfThisBuild) or said to need no
// carrying. Every version's spec has only keys that name a field of the groups (its encoder
// reads it there), under that name, and each comes back as it was sent; a field a version does
// not carry reads as not sent. In every version, a change of a field of the Registration group,
// and only of it, decides that a driver no longer registers as the receiver's; a field not sent
// counts as the receiver's.
func TestSpecOnTheWire(t *testing.T) {
	full := filled(t, reflect.TypeFor[config.Driver]()).Interface().(config.Driver)
	// notCarried: fields the receiver takes from its own configuration, never from the wire.
	// SparePath, a device plugin's third registration socket, follows from SocketName, the
	// type and the endpoint; a socket handed over from it is taken when it is one of the
	// receiver's own paths. Display is what the receiver's status shows of its own file.
	// HealthTimeout bounds a liveness check, which whoever answers it makes with its own.
	notCarried := func(l leaf) bool {
		return l.group == "Display" || l.field.Name == "SparePath" || l.field.Name == "HealthTimeout"
	}
	byName := map[string]leaf{}
	for _, l := range leaves() {
		if notCarried(l) {
			reflect.ValueOf(&full).Elem().FieldByIndex(l.index).SetZero()
			for v, spec := range specOf {
				if _, on := spec.FieldByName(l.field.Name); on {
					t.Errorf("config.%s.%s is the receiver's own, yet on version %d's wire", l.group, l.field.Name, v)
				}
			}
			continue
		}
		byName[l.field.Name] = l
		w, ok := specOf[maxVersion].FieldByName(l.field.Name)
		if !ok || strings.Split(w.Tag.Get("json"), ",")[0] != l.field.Name {
			t.Errorf("config.%s.%s is not on the hand-over's wire under its name: carry it in a new protocol version, or say here why not",
				l.group, l.field.Name)
		}
	}
	for i := range reflect.TypeFor[config.Backoff]().NumField() {
		f := reflect.TypeFor[config.Backoff]().Field(i)
		if w, ok := reflect.TypeFor[wireBackoff]().FieldByName(f.Name); !ok || w.Tag.Get("json") != f.Name {
			t.Errorf("config.Backoff.%s is not on the hand-over's wire under its name", f.Name)
		}
	}
	for v := minVersion; v <= maxVersion; v++ {
		spec, ok := specOf[v]
		if !ok {
			t.Fatalf("version %d has no spec in this test", v)
		}
		// What version v carries, and what it reads as not sent.
		want, wantUnsent := full, unsent{}
		var carried []leaf
		for i := range spec.NumField() {
			f := spec.Field(i)
			l, ok := byName[f.Name]
			if !ok || strings.Split(f.Tag.Get("json"), ",")[0] != f.Name {
				t.Errorf("version %d: the spec's %s is no field of config.Driver's groups under its name", v, f.Name)
				continue
			}
			carried = append(carried, l)
		}
		for _, l := range leaves() {
			if !slices.ContainsFunc(carried, func(c leaf) bool { return c.field.Name == l.field.Name }) {
				reflect.ValueOf(&want).Elem().FieldByIndex(l.index).SetZero()
				if l.group == "Registration" {
					wantUnsent = append(wantUnsent, l.field.Name)
				}
			}
		}
		if v == 1 {
			// v0.1.0 gives a second path to a driver whose endpoint is a pattern only, and
			// full's is none: version 1 says the path v0.1.0 would (TestVersion1CarriesWhatV010Serves).
			want.AltSocketPath = ""
		}
		var m struct {
			Drivers []json.RawMessage `json:"drivers"`
		}
		if err := json.Unmarshal(mustMarshal(t, &Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{{Spec: full}}}), &m); err != nil {
			t.Fatal(err)
		}
		b := m.Drivers[0]
		var back Driver
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back.Spec, want) || !slices.Equal(back.unsent, wantUnsent) {
			t.Errorf("version %d: configuration after the wire:\n%+v (unsent %v)\nwant\n%+v (unsent %v)", v, back.Spec, back.unsent, want, wantUnsent)
		}
		for _, l := range carried {
			own := full
			reflect.ValueOf(&own).Elem().FieldByIndex(l.index).SetZero()
			// kubelet sees the registration's fields, but for those that follow from the others
			// (derived), which the receiver derives itself.
			visible := l.group == "Registration" && !slices.Contains(derived, l.field.Name)
			if got := back.RegistersAs(own); got == visible {
				t.Errorf("version %d: config.%s.%s changed: RegistersAs = %v, want %v", v, l.group, l.field.Name, got, !visible)
			}
			// Not sent: the receiver's own.
			var obj map[string]map[string]any
			json.Unmarshal(b, &obj)
			delete(obj["spec"], l.field.Name)
			nb, _ := json.Marshal(obj)
			var unsent Driver
			if err := json.Unmarshal(nb, &unsent); err != nil {
				t.Fatal(err)
			}
			if l.field.Name != "Name" && !unsent.RegistersAs(full) {
				t.Errorf("version %d: config.%s.%s not sent: RegistersAs = false, want the receiver's own to count", v, l.group, l.field.Name)
			}
		}
	}
}

// filled is a value of type typ with every field set, not zero.
func filled(t *testing.T, typ reflect.Type) reflect.Value {
	t.Helper()
	v := reflect.New(typ).Elem()
	switch typ.Kind() {
	case reflect.String:
		v.SetString("x-" + typ.Name())
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int64:
		v.SetInt(7)
	case reflect.Float64:
		v.SetFloat(1.5)
	case reflect.Slice:
		v = reflect.Append(reflect.MakeSlice(typ, 0, 1), filled(t, typ.Elem()))
	case reflect.Map:
		v = reflect.MakeMap(typ)
		v.SetMapIndex(filled(t, typ.Key()), filled(t, typ.Elem()))
	case reflect.Struct:
		for i := range typ.NumField() {
			v.Field(i).Set(filled(t, typ.Field(i).Type))
		}
	default:
		t.Fatalf("filled has no value of %s yet: add a case for its kind there", typ)
	}
	return v
}

// TestWireTypesAreTagged: every type on the wire, as each version writes a message (wireMsg of
// its drivers) and as the decoder reads one (Msg, a driver read as wireDriverV2), is this
// package's (or time's), every field with its key: nothing another package encodes its own
// way, and no field whose key is its Go name by default, which a rename would change silently.
// The envelope written has the keys of the one read.
func TestWireTypesAreTagged(t *testing.T) {
	// walk checks typ and what it holds; methods is the method a type must not have of its own
	// (MarshalJSON for what is written, UnmarshalJSON for what is read).
	walk := func(root string, typ reflect.Type, methods string) map[reflect.Type]bool {
		seen := map[reflect.Type]bool{}
		var walk func(path string, typ reflect.Type)
		walk = func(path string, typ reflect.Type) {
			for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice || typ.Kind() == reflect.Map {
				if typ.Kind() == reflect.Map && typ.Key().Kind() != reflect.String {
					t.Errorf("%s: a map keyed by %s", path, typ.Key())
				}
				if typ == reflect.TypeFor[[]byte]() {
					return
				}
				typ = typ.Elem()
			}
			if typ == reflect.TypeFor[Driver]() {
				if methods == "MarshalJSON" {
					t.Errorf("%s: a Driver written as itself, in no version's encoding", path)
					return
				}
				typ = reflect.TypeFor[wireDriverV2]() // Driver.UnmarshalJSON reads it so
			}
			switch {
			case typ == reflect.TypeFor[time.Time]() || typ == reflect.TypeFor[time.Duration]():
				return
			case typ.PkgPath() != "" && typ.PkgPath() != reflect.TypeFor[Msg]().PkgPath():
				t.Errorf("%s: %s is another package's type", path, typ)
				return
			case typ.Kind() == reflect.Interface:
				t.Errorf("%s: an interface", path)
				return
			case typ.Kind() != reflect.Struct || seen[typ]:
				return
			}
			seen[typ] = true
			if _, ok := reflect.PointerTo(typ).MethodByName(methods); ok && typ != reflect.TypeFor[Msg]() {
				t.Errorf("%s: %s has a %s of its own", path, typ, methods)
			}
			for i := range typ.NumField() {
				f := typ.Field(i)
				name := strings.Split(f.Tag.Get("json"), ",")[0]
				if f.Anonymous || name == "" || name == "-" {
					t.Errorf("%s.%s: no key of its own (embedded, untagged or left out)", path, f.Name)
					continue
				}
				walk(path+"."+name, f.Type)
			}
		}
		walk(root, typ)
		return seen
	}
	written := map[int][3]reflect.Type{
		1: {reflect.TypeFor[wireMsg[*wireDriverV1]](), reflect.TypeFor[wireSpecV1](), reflect.TypeFor[wireStatusV1]()},
		2: {reflect.TypeFor[wireMsg[*wireDriverV2]](), reflect.TypeFor[wireSpecV2](), reflect.TypeFor[wireStatusV2]()},
	}
	for v := minVersion; v <= maxVersion; v++ {
		w, ok := written[v]
		if !ok {
			t.Fatalf("version %d has no wire types in this test", v)
		}
		if seen := walk(fmt.Sprintf("version %d", v), w[0], "MarshalJSON"); !seen[w[1]] || !seen[w[2]] {
			t.Errorf("the walk of version %d missed the spec or the status", v)
		}
	}
	if seen := walk("read", reflect.TypeFor[Msg](), "UnmarshalJSON"); !seen[reflect.TypeFor[wireSpecV2]()] || !seen[reflect.TypeFor[wireStatusV2]()] {
		t.Error("the walk of what is read missed the spec or the status")
	}
	msg, env := reflect.TypeFor[Msg](), reflect.TypeFor[wireMsg[*wireDriverV2]]()
	for i := range max(msg.NumField(), env.NumField()) {
		if i >= msg.NumField() || i >= env.NumField() || msg.Field(i).Name != env.Field(i).Name || msg.Field(i).Tag != env.Field(i).Tag {
			t.Errorf("the envelope written (wireMsg) and Msg differ at their field %d", i)
		}
	}
}

// TestLastErrorIsCutOnTheWire: a driver's last error is cut to maxLastError bytes of valid
// UTF-8 on the wire, so that any number of drivers fit the hand-over's batches.
func TestLastErrorIsCutOnTheWire(t *testing.T) {
	long := strings.Repeat("kubelet rejected the registration: é ", 2000) // 76 KB
	if got := statusWire(Status{LastError: long}).LastError; len(got) > maxLastError+len("…") || !utf8.ValidString(got) {
		t.Errorf("a last error of %d bytes on the wire as %d bytes (valid UTF-8: %v)", len(long), len(got), utf8.ValidString(got))
	}
	if got := statusWire(Status{LastError: "short"}).LastError; got != "short" {
		t.Errorf("a short last error on the wire as %q", got)
	}
}

// TestVersion1CarriesWhatV010Serves: v0.1.0 gives a driver a second registration path only
// when its endpoint is a pattern, and none a third. A batch in version 1 says a DRA driver
// with a fixed endpoint has no second path (v0.1.0 would otherwise take it for a driver that
// registers differently, and register it anew), and carries no socket at a path v0.1.0 does
// not have (it would refuse it, and leave it at its path for kubelet to keep); Unsent gives
// those back, for the holder to withdraw. Version 2 carries every socket and path.
func TestVersion1CarriesWhatV010Serves(t *testing.T) {
	dir := "/var/lib/kubelet/plugins_registry"
	spec := func(name, typ, endpoint string) config.Driver {
		d := config.Driver{Registration: config.Registration{Name: name, Type: typ, Endpoint: endpoint, SocketName: name + "-reg.sock"}}
		d.SetSocketPaths(dir)
		return d
	}
	sockets := func(paths ...string) []*Socket {
		var out []*Socket
		for _, p := range paths {
			out = append(out, &Socket{Path: p})
		}
		return out
	}
	dra := spec("gpu.example.com", config.DRAPlugin, "/var/lib/kubelet/plugins/gpu/dra.sock")
	dev := spec("example.com/dev", config.DevicePlugin, "/var/lib/kubelet/device-plugins/dev-*.sock")
	if dra.AltSocketPath == "" || dev.AltSocketPath == "" || dev.SparePath == "" {
		t.Fatalf("the drivers' paths: %+v, %+v", dra.Registration, dev.Registration)
	}
	snap := &Snapshot{}
	snap.Add(&Driver{Spec: dra, Sockets: sockets(dra.AltSocketPath)})
	snap.Add(&Driver{Spec: dev, Sockets: sockets(dev.AltSocketPath, dev.SparePath)})
	paths := func(ss []*wireSocket) []string {
		var out []string
		for _, s := range ss {
			out = append(out, s.Path)
		}
		return out
	}
	for _, tt := range []struct {
		h            *Driver
		alt1         string   // the second path version 1 says
		sent1, sent2 []string // the sockets each version carries
	}{
		{snap.drivers[dra.Name], "", nil, []string{dra.AltSocketPath}},
		{snap.drivers[dev.Name], dev.AltSocketPath, []string{dev.AltSocketPath}, []string{dev.AltSocketPath, dev.SparePath}},
	} {
		w1, w2 := tt.h.wireV1(), tt.h.wireV2()
		if w1.Spec.AltSocketPath != tt.alt1 || *w2.Spec.AltSocketPath != tt.h.Spec.AltSocketPath {
			t.Errorf("%s: second path %q in version 1, %q in version 2; want %q and %q",
				tt.h.Spec.Name, w1.Spec.AltSocketPath, *w2.Spec.AltSocketPath, tt.alt1, tt.h.Spec.AltSocketPath)
		}
		if got := paths(w1.Sockets); !slices.Equal(got, tt.sent1) {
			t.Errorf("%s: version 1 carries the sockets %q, want %q", tt.h.Spec.Name, got, tt.sent1)
		}
		if got := paths(w2.Sockets); !slices.Equal(got, tt.sent2) {
			t.Errorf("%s: version 2 carries the sockets %q, want %q", tt.h.Spec.Name, got, tt.sent2)
		}
	}
	if n := snap.Unsent(2).Len(); n != 0 {
		t.Errorf("version 2 leaves the sockets of %d drivers unsent", n)
	}
	unsent := snap.Unsent(1)
	var left []string
	for _, h := range unsent.TakeAll() {
		for _, hs := range h.Sockets {
			left = append(left, hs.Path)
		}
	}
	slices.Sort(left)
	if want := []string{dev.SparePath, dra.AltSocketPath}; !slices.Equal(left, want) {
		t.Errorf("unsent in version 1: %q, want %q", left, want)
	}
	if got := len(snap.drivers[dra.Name].Sockets) + len(snap.drivers[dev.Name].Sockets); got != 1 {
		t.Errorf("the snapshot keeps %d sockets after Unsent, want the device plugin's second path's alone", got)
	}
}
