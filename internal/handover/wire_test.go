package handover

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
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

// update rewrites the golden file of the current protocol version (maxVersion) from
// goldenExchange, as long as its shape stays: a new shape is a new version.
var update = flag.Bool("update", false, "rewrite testdata/protocol-v<maxVersion>.json")

// goldenFile is the golden file of protocol version v: its messages, as a build that speaks
// it writes them (version 1's as v0.1.0 wrote them, e2e/registration's TestHandoverGoldenV010).
func goldenFile(v int) string { return filepath.Join("testdata", fmt.Sprintf("protocol-v%d.json", v)) }

// exchanged is one message of a golden file: who sent it, and the message.
type exchanged struct {
	From string          `json:"from"` // holder or new
	Msg  json.RawMessage `json:"msg"`
}

// readGolden reads the golden file of version v.
func readGolden(t *testing.T, v int) []exchanged {
	t.Helper()
	b, err := os.ReadFile(goldenFile(v))
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
// refusal and an abort.
func goldenExchange(t *testing.T, v int) []byte {
	t.Helper()
	d := fullDriver()
	msgs := []struct {
		from string
		m    *Msg
	}{
		{"new", &Msg{Type: MsgHello, MinVersion: minVersion, Version: v}},
		{"holder", &Msg{Type: MsgRefuse, Reason: "another hand-over is in progress"}},
		{"holder", &Msg{Type: MsgWelcome, Version: v}},
		{"new", &Msg{Type: MsgTake, Version: v}},
		{"holder", &Msg{Type: MsgBatch, Version: v, Drivers: []*Driver{d}, Sockets: len(d.Sockets), Last: true, Lock: true}},
		{"new", &Msg{Type: MsgAbort, Reason: "batch: 1 descriptors for 2 sockets"}},
		{"new", &Msg{Type: MsgAck, Version: v}},
		{"holder", &Msg{Type: MsgReleased, Version: v}},
	}
	var out []exchanged
	for _, x := range msgs {
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
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				walk(path+"."+k, x)
			}
		case []any:
			for _, x := range v {
				walk(path+"[]", x)
			}
		default:
			out = append(out, fmt.Sprintf("%s:%T", path, v))
		}
	}
	for _, m := range msgs {
		walk(fmt.Sprintf("%s:%v", m.From, m.Msg["type"]), m.Msg)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// TestGoldenOfTheCurrentVersion: what this build writes in its highest version is that
// version's golden file. -update rewrites the file, values only: a change of its keys or of
// their types is what a peer of that version would misread, and needs a new version (a new
// golden file, which -update then writes), while the older versions' files stay as they are.
func TestGoldenOfTheCurrentVersion(t *testing.T) {
	got := goldenExchange(t, maxVersion)
	want, err := os.ReadFile(goldenFile(maxVersion))
	if err != nil && !(os.IsNotExist(err) && *update) {
		t.Fatal(err)
	}
	if want != nil {
		if g, w := shape(t, got), shape(t, want); !slices.Equal(g, w) {
			t.Fatalf("the messages of protocol version %d changed shape, which a peer of that version would misread: "+
				"add version %d (maxVersion), keep reading the older ones, and write its golden file with -update.\n"+
				"written now, not in %s: %v\nin it, not written now: %v",
				maxVersion, maxVersion+1, goldenFile(maxVersion), missing(g, w), missing(w, g))
		}
	}
	if *update {
		if err := os.WriteFile(goldenFile(maxVersion), got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if !bytes.Equal(got, want) {
		t.Errorf("this build writes protocol version %d otherwise than %s (go test -update rewrites it):\n%s", maxVersion, goldenFile(maxVersion), got)
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

// TestGoldenFixtureIsFull: the driver of the golden files sets every field of the wire, so that
// a field added to it changes the current version's golden file (TestGoldenOfTheCurrentVersion).
func TestGoldenFixtureIsFull(t *testing.T) {
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
	w := fullDriver().wire()
	walk("driver", reflect.ValueOf(w))
	// One of the two sockets is the previous one, and only one awaits a verdict.
	zero = slices.DeleteFunc(zero, func(p string) bool {
		return p == "driver.Sockets[1].Prev" || p == "driver.Sockets[1].AwaitsVerdict" || p == "driver.Sockets[1].Registered"
	})
	if len(zero) > 0 {
		t.Errorf("fields of the wire the golden file's driver leaves zero: %v", zero)
	}
}

// TestGoldenFilesDecode: every version this build speaks has a golden file, and this build
// reads each: every message, each driver with its configuration, its status and its sockets.
// Version 1's is v0.1.0's own output: four drivers, three of them registered on a socket each.
func TestGoldenFilesDecode(t *testing.T) {
	for v := minVersion; v <= maxVersion; v++ {
		t.Run(fmt.Sprint("version ", v), func(t *testing.T) {
			var drivers []*Driver
			for _, x := range readGolden(t, v) {
				var m Msg
				if err := json.Unmarshal(x.Msg, &m); err != nil {
					t.Fatalf("%s: %v", x.Msg, err)
				}
				if m.Type != MsgHello && m.Type != MsgRefuse && m.Type != MsgAbort && m.Version != v {
					t.Errorf("a %s in version %d in the golden file of version %d", m.Type, m.Version, v)
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
				drivers = append(drivers, m.Drivers...)
			}
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
			if v != 1 {
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

// v010Drivers are the drivers of version 1's golden file, as v0.1.0 sent them (JSON objects),
// and as this build reads them.
func v010Drivers(t *testing.T) ([]map[string]any, []*Driver) {
	t.Helper()
	var raw []map[string]any
	var read []*Driver
	for _, x := range readGolden(t, 1) {
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

// TestV010TakenOverAsItRegistered: each driver v0.1.0 handed over (version 1's golden file)
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

		// Anything kubelet sees, changed.
		for _, change := range []func(*config.Driver){
			func(c *config.Driver) { c.Type += "Other" },
			func(c *config.Driver) { c.Endpoint += ".new" },
			func(c *config.Driver) { c.SupportedVersions = append(slices.Clone(c.SupportedVersions), "v9") },
			func(c *config.Driver) { c.SocketPath += ".new" },
			func(c *config.Driver) { c.AltSocketPath = c.SocketPath + ".alt" },
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

// TestSpecOnTheWire: every field of config.Driver's groups that a peer needs is on the wire
// under its own name (the key v0.1.0 sent), and comes back as it was sent: a field added to a
// group fails here until it is carried (a new protocol version, TestGoldenOfTheCurrentVersion)
// or said to need no carrying. A change of a field of the Registration group, and only of it,
// decides that a driver no longer registers as the receiver's; a field not sent counts as the
// receiver's.
func TestSpecOnTheWire(t *testing.T) {
	full := filled(t, reflect.TypeFor[config.Driver]()).Interface().(config.Driver)
	// notCarried: fields the receiver takes from its own configuration, never from the wire.
	// SparePath, a device plugin's third registration socket, follows from SocketName, the
	// type and the endpoint; a socket handed over from it is taken when it is one of the
	// receiver's own paths. Display is what the receiver's status shows of its own file.
	notCarried := func(l leaf) bool { return l.group == "Display" || l.field.Name == "SparePath" }
	for _, l := range leaves() {
		if notCarried(l) {
			reflect.ValueOf(&full).Elem().FieldByIndex(l.index).SetZero()
			if _, on := reflect.TypeFor[wireSpec]().FieldByName(l.field.Name); on {
				t.Errorf("config.%s.%s is the receiver's own, yet on the wire", l.group, l.field.Name)
			}
			continue
		}
		w, ok := reflect.TypeFor[wireSpec]().FieldByName(l.field.Name)
		if !ok || strings.Split(w.Tag.Get("json"), ",")[0] != l.field.Name {
			t.Errorf("config.%s.%s is not on the hand-over's wire under its name: carry it in wireSpec (a new protocol version), or say here why not",
				l.group, l.field.Name)
		}
	}
	for i := range reflect.TypeFor[config.Backoff]().NumField() {
		f := reflect.TypeFor[config.Backoff]().Field(i)
		if w, ok := reflect.TypeFor[wireBackoff]().FieldByName(f.Name); !ok || w.Tag.Get("json") != f.Name {
			t.Errorf("config.Backoff.%s is not on the hand-over's wire under its name", f.Name)
		}
	}
	b, err := json.Marshal(&Driver{Spec: full})
	if err != nil {
		t.Fatal(err)
	}
	var back Driver
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back.Spec, full) || !slices.Equal(back.unsent, unsent{"SparePath"}) {
		t.Errorf("configuration after the wire:\n%+v (unsent %v)\nwant\n%+v", back.Spec, back.unsent, full)
	}
	for _, l := range leaves() {
		if notCarried(l) {
			continue
		}
		own := full
		reflect.ValueOf(&own).Elem().FieldByIndex(l.index).SetZero()
		visible := l.group == "Registration"
		if got := back.RegistersAs(own); got == visible {
			t.Errorf("config.%s.%s changed: RegistersAs = %v, want %v", l.group, l.field.Name, got, !visible)
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
			t.Errorf("config.%s.%s not sent: RegistersAs = false, want the receiver's own to count", l.group, l.field.Name)
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
	case reflect.Struct:
		for i := range typ.NumField() {
			v.Field(i).Set(filled(t, typ.Field(i).Type))
		}
	default:
		t.Fatalf("no filled value of %s", typ)
	}
	return v
}

// TestWireTypesAreTagged: every type on the wire is this package's (or time's), every field
// with its key: nothing another package encodes its own way, and no field whose key is its Go
// name by default, which a rename would change silently.
func TestWireTypesAreTagged(t *testing.T) {
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
		if typ == reflect.TypeFor[Driver]() { // encoded as wireDriver
			typ = reflect.TypeFor[wireDriver]()
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
		if _, ok := reflect.PointerTo(typ).MethodByName("MarshalJSON"); ok && typ != reflect.TypeFor[wireDriver]() {
			t.Errorf("%s: %s encodes itself", path, typ)
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
	walk("msg", reflect.TypeFor[Msg]())
	if !seen[reflect.TypeFor[wireSpec]()] || !seen[reflect.TypeFor[wireStatus]()] {
		t.Error("the walk missed the spec or the status")
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
