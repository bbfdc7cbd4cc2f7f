package registration

import (
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
)

// takeEverything plays a successor that says hello on reg's hand-over socket (and take, after
// the holder's welcome), takes every batch with its descriptors (the sockets and the lock's)
// and then says nothing, keeping them all until the test ends. It returns when it said the
// word that paused the holder, and how many descriptors it holds.
func takeEverything(t *testing.T, reg string) (time.Time, int) {
	t.Helper()
	path := filepath.Join(reg, ".multireg.handover")
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	t.Cleanup(func() {
		c.Close()
		for _, fd := range fds {
			unix.Close(fd)
		}
	})
	hello := time.Now()
	if _, err := c.Write([]byte(`{"type":"hello","minVersion":1,"version":2}`)); err != nil {
		t.Fatal(err)
	}
	b, oob := make([]byte, 1<<20), make([]byte, unix.CmsgSpace(4*253))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(b, oob)
		if err != nil {
			t.Fatalf("read a batch from %s: %v", path, err)
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			t.Fatal(err)
		}
		for i := range msgs {
			got, err := unix.ParseUnixRights(&msgs[i])
			if err != nil {
				t.Fatal(err)
			}
			fds = append(fds, got...)
		}
		var m struct {
			Type string `json:"type"`
			Last bool   `json:"last"`
		}
		err = json.Unmarshal(b[:n], &m)
		if err == nil && m.Type == "welcome" {
			hello = time.Now() // the holder pauses from the take on (protocol version 2)
			if _, err := c.Write([]byte(`{"type":"take","version":2}`)); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err != nil || m.Type != "batch" {
			t.Fatalf("the holder sent %q (%v), want a batch", b[:n], err)
		}
		if m.Last {
			return hello, len(fds)
		}
	}
}

// 8. A successor that takes every socket and the lock's descriptor and never acknowledges
// leaves the holder serving again within a couple of seconds — Ready, role serving, every
// socket answering — still holding the directory, with no driver registered again; a real
// hand-over works after.
func TestHandoverNeverAcknowledged(t *testing.T) {
	t.Parallel()
	const n = 30
	e, ds, first := handoverFleet(t, n, mrproc.Options{})
	counts := e.Registrations(ds)
	hello, got := takeEverything(t, e.Reg)
	if got != n+1 {
		t.Fatalf("%d descriptors taken, want %d sockets and the lock", got, n)
	}
	wait.For(t, 5*time.Second, "the holder to serve every socket again, Ready", func() bool {
		code, _, err := first.Get(t, "/readyz")
		return err == nil && code == 200 && first.Status(t).Instance.Role == "serving" &&
			registeredEverywhere(t, e, first, ds) && e.answering(ds)
	})
	t.Logf("the holder serves every socket again %s after the take", time.Since(hello).Round(time.Millisecond))
	if first.Count("hand-over failed; this instance goes on serving every driver", "") != 1 {
		t.Error("the holder did not say the hand-over failed")
	}
	if fmt.Sprint(e.Registrations(ds)) != fmt.Sprint(counts) {
		t.Errorf("drivers registered again: %v, were %v", e.Registrations(ds), counts)
	}
	second := mrproc.StartWith(t, mrproc.Options{}, e.Cfg)
	wait.For(t, registerTimeout, "a real successor's hand-over, with the other still holding its copies", func() bool {
		return second.Count(msgTookOver, "") == 1 && first.Count(msgHanded, "") == 1
	})
	wait.For(t, registerTimeout, "the successor to serve every driver", func() bool {
		return registeredEverywhere(t, e, second, ds) && e.answering(ds)
	})
	if st := second.Status(t); st.Instance.Role != "serving" || !strings.Contains(fmt.Sprint(st.Instance.Inherited), fmt.Sprint(n)) {
		t.Errorf("the successor: %+v, want serving %d sockets taken over", st.Instance, n)
	}
	first.Signal(t, syscall.SIGTERM)
	if code := first.Wait(t, exitTimeout); code != 0 {
		t.Errorf("the old holder exited %d", code)
	}
}
