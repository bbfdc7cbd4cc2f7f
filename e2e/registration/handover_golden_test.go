package registration

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
)

// updateGolden rewrites the product's golden file of hand-over protocol version 1 from what
// v0.1.0 sends (TestHandoverGoldenV010).
var updateGolden = flag.Bool("update-golden", false, "rewrite internal/handover/testdata/v0.1.0/protocol-v1.json from v0.1.0's messages")

// goldenV1 is the product's golden file of protocol version 1, which its unit tests decode.
const goldenV1 = "../../internal/handover/testdata/v0.1.0/protocol-v1.json"

// goldenRoot replaces the test's temporary directory in the golden file's paths.
const goldenRoot = "/node"

// exchanged is one message of a hand-over, as a golden file holds it: who sent it, and its
// JSON as sent.
type exchanged struct {
	From string          `json:"from"` // holder or new
	Msg  json.RawMessage `json:"msg"`
}

// 5c. What v0.1.0 says in a hand-over is what the product's golden file of protocol version 1
// says: a fake instance between two v0.1.0 processes takes the directory from the first (as a
// new instance) and hands it to the second (as a holder), relaying the batch and the
// descriptors unchanged, and records both sides' messages. The second serves every socket:
// kubelet sees nothing. The messages must have, key for key, the golden file's shape; with
// -update-golden they become it (the test's directory replaced by goldenRoot).
func TestHandoverGoldenV010(t *testing.T) {
	t.Parallel()
	old, err := mrproc.BinaryAt(v010)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	ds := []driver{
		{Name: "csi.example.com", Type: "CSIPlugin"},
		{Name: "dra.example.com", Type: "DRAPlugin"},
		{Name: "example.com/dev", Type: "DevicePlugin"},
	}
	absent := driver{Name: "absent.example.com", Type: "CSIPlugin"} // no endpoint on this node
	e.StartEndpoints(ds)
	cfg := e.WriteConfig(append(slices.Clone(ds), absent))
	first := mrproc.StartWith(t, mrproc.Options{Bin: old}, cfg)
	wait.For(t, registerTimeout, "every driver registered", func() bool { return registeredEverywhere(t, e, first, ds) })
	for _, d := range ds {
		e.AwaitNodeInfoRecorded(first, d) // the CSI driver's nodeInfo is in the golden file
	}
	before, events := e.sockets(ds), len(e.K.Events())

	// From v0.1.0 as the holder: its batches and its release, to a hello in version 1.
	var golden []exchanged
	hc := dialPacket(t, filepath.Join(e.Reg, ".multireg.handover"))
	sendRaw(t, hc, []byte(`{"type":"hello","minVersion":1,"version":1}`))
	var batches [][]byte
	var files []int
	lock := -1
	for lock < 0 {
		b, fds := recvRaw(t, hc)
		var m struct {
			Type string `json:"type"`
			Last bool   `json:"last"`
		}
		if err := json.Unmarshal(b, &m); err != nil || m.Type != "batch" {
			t.Fatalf("v0.1.0 answered %s (%v), want a batch", b, err)
		}
		batches = append(batches, b)
		golden = append(golden, exchanged{From: "holder", Msg: b})
		if m.Last {
			lock = fds[len(fds)-1]
			fds = fds[:len(fds)-1]
		}
		files = append(files, fds...)
	}
	t.Cleanup(func() {
		for _, fd := range append(files, lock) {
			syscall.Close(fd)
		}
	})
	sendRaw(t, hc, []byte(`{"type":"ack","version":1}`))
	released, _ := recvRaw(t, hc)
	golden = append(golden, exchanged{From: "holder", Msg: released})
	hc.Close()
	wait.For(t, registerTimeout, "v0.1.0 to say it handed over", func() bool { return first.Count(msgHanded, "") == 1 })

	// To v0.1.0 as the new instance: its hello and its ack, for the same batches.
	l := listenPacket(t, filepath.Join(e.Reg, ".multireg.handover"))
	second := mrproc.StartWith(t, mrproc.Options{Bin: old}, cfg)
	c, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hello, _ := recvRaw(t, c)
	golden = append([]exchanged{{From: "new", Msg: hello}}, golden...)
	next := 0
	for i, b := range batches {
		var m struct {
			Sockets int `json:"sockets"`
		}
		json.Unmarshal(b, &m)
		fds := files[next : next+m.Sockets]
		next += m.Sockets
		if i == len(batches)-1 {
			fds = append(slices.Clone(fds), lock)
		}
		sendRaw(t, c, b, fds...)
	}
	ack, _ := recvRaw(t, c)
	golden = slices.Insert(golden, len(golden)-1, exchanged{From: "new", Msg: ack})
	sendRaw(t, c, released)
	wait.For(t, registerTimeout, "the second v0.1.0 to take over", func() bool { return second.Count(msgTookOver, "") == 1 })
	e.untouched(t, ds, before, events)
	stopIdle(t, first)

	got := normalized(t, golden, e.Dir)
	if *updateGolden {
		if err := os.WriteFile(goldenV1, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(goldenV1)
	if err != nil {
		t.Fatal(err)
	}
	if g, w := shape(t, got), shape(t, want); !slices.Equal(g, w) {
		t.Errorf("v0.1.0's messages are not shaped as %s (-update-golden rewrites it):\nsent, not in it: %v\nin it, not sent: %v",
			goldenV1, without(g, w), without(w, g))
	}
}

// normalized is the golden file of msgs: indented, the directory dir replaced by goldenRoot.
func normalized(t *testing.T, msgs []exchanged, dir string) []byte {
	t.Helper()
	b, err := json.MarshalIndent(msgs, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return append(bytes.ReplaceAll(b, []byte(dir), []byte(goldenRoot)), '\n')
}

// shape lists the keys of every object in a golden file's messages, by sender, message type
// and path (the elements of an array together, whatever their order), and the type of every
// value: what a version's messages must keep.
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

// without lists what a holds and b does not.
func without(a, b []string) []string {
	return slices.DeleteFunc(slices.Clone(a), func(x string) bool { return slices.Contains(b, x) })
}

// dialPacket connects to a hand-over socket.
func dialPacket(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// listenPacket listens for hand-over requests at path, in place of what is there.
func listenPacket(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	os.Remove(path)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// sendRaw sends one hand-over message with descriptors.
func sendRaw(t *testing.T, c *net.UnixConn, b []byte, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		t.Fatal(err)
	}
}

// recvRaw reads one hand-over message and its descriptors.
func recvRaw(t *testing.T, c *net.UnixConn) ([]byte, []int) {
	t.Helper()
	b, oob := make([]byte, 1<<20), make([]byte, syscall.CmsgSpace(4*200))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, oobn, _, _, err := c.ReadMsgUnix(b, oob)
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		t.Fatal(err)
	}
	for i := range msgs {
		rights, err := syscall.ParseUnixRights(&msgs[i])
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, rights...)
	}
	return b[:n], fds
}
