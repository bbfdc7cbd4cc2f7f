package handover

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// holderSends makes a holder of dir that answers one hand-over request, in version 1, with
// batches: each with its drivers' sockets' descriptors in order, and lock's when it says Lock;
// then released if the new instance acknowledges. The channel gives the types of the new
// instance's answers once it has gone.
func holderSends(t *testing.T, dir string, lock *os.File, batches ...*Msg) <-chan []string {
	t.Helper()
	answers := make(chan []string, 1)
	fakeHolder(t, dir, func(hc Conn) {
		var got []string
		defer func() { answers <- got }()
		for _, m := range batches {
			var fs []*os.File
			for _, hd := range m.Drivers {
				for _, hs := range hd.Sockets {
					fs = append(fs, hs.File)
				}
			}
			if m.Lock {
				fs = append(fs, lock)
			}
			if hc.Send(m, fs...) != nil {
				break // the new instance gave up: its answer is read below
			}
		}
		for {
			m, fs, err := hc.Recv()
			CloseAll(fs)
			if errors.Is(err, syscall.ECONNRESET) {
				continue // it closed with batches unread: what it said before is read next
			}
			if err != nil {
				return
			}
			got = append(got, m.Type)
			if m.Type == MsgAck {
				hc.Send(&Msg{Type: MsgReleased, Version: 1})
			}
		}
	})
	return answers
}

// listening is a socket a holder hands over for name in dir: listening at dir/name-reg.sock,
// with its descriptor (closed when the test ends).
func listening(t *testing.T, dir, name string) *Socket {
	t.Helper()
	path := filepath.Join(dir, name+"-reg.sock")
	l, err := testkit.ListenUnlinked(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return handedSocket(t, l, path)
}

// handed is a driver named name as a holder hands it over, with sockets.
func handed(name string, sockets ...*Socket) *Driver {
	return &Driver{
		Spec:     config.Driver{Registration: config.Registration{Name: name, Type: config.DRAPlugin, Endpoint: "/plugins/" + name + "/dra.sock"}},
		Endpoint: "/plugins/" + name + "/dra.sock",
		Status:   Status{Phase: "Registered", LastError: "an error of long ago", Results: map[string]int{"registered": 1}},
		Sockets:  sockets,
	}
}

// inBatches is drivers in batches of batchDrivers, in version 1, the last one with the lock.
func inBatches(drivers []*Driver) []*Msg {
	var out []*Msg
	for i := 0; i == 0 || i < len(drivers); i += batchDrivers {
		m := &Msg{Type: MsgBatch, Version: 1, Drivers: drivers[i:min(i+batchDrivers, len(drivers))]}
		for _, hd := range m.Drivers {
			m.Sockets += len(hd.Sockets)
		}
		out = append(out, m)
	}
	out[len(out)-1].Last, out[len(out)-1].Lock = true, true
	return out
}

// openFDs is the number of this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(es)
}

// TestAskBoundsWhatItAccepts: a new instance accepts of a hand-over what its own configuration
// can use: every driver it configures, whole; of as many others as it configures (minRetired at
// least), their sockets alone, to withdraw (nothing of one without sockets); two sockets a
// driver. A holder that hands over more — more drivers, a driver with more sockets, a batch
// before the last without drivers, more bytes — is out of protocol: the new instance says
// abort, keeps the batches received whole before, and closes the descriptors of the others at
// once.
func TestAskBoundsWhatItAccepts(t *testing.T) {
	own := []string{"a.example.com", "b.example.com"}
	many := func(n int) []string { // n drivers configured, none handed over
		var names []string
		for i := range n {
			names = append(names, fmt.Sprintf("configured-%d.example.com", i))
		}
		return names
	}
	big := func(name string) *Driver { // a driver of about 140 KiB of JSON, in a message of its own
		hd := handed(name)
		hd.NodeInfo = make([]byte, 100<<10)
		return hd
	}
	for _, tt := range []struct {
		name string
		own  []string
		// hand makes what the holder hands over, its sockets in dir.
		hand func(t *testing.T, dir string) []*Msg
		want string // the new instance's answers
		// configured and retired: the drivers kept whole, and those kept for their sockets.
		configured, retired int
	}{
		{"as many others as it accepts", own, func(t *testing.T, dir string) []*Msg {
			ds := []*Driver{handed("a.example.com", listening(t, dir, "a")), handed("b.example.com")}
			for i := range minRetired {
				name := fmt.Sprintf("gone-%d.example.com", i)
				ds = append(ds, handed(name, listening(t, dir, name)))
			}
			return inBatches(ds)
		}, "[ack]", 2, minRetired},
		{"one more", own, func(t *testing.T, dir string) []*Msg {
			ds := []*Driver{handed("a.example.com", listening(t, dir, "a")), handed("b.example.com")}
			for i := range minRetired + 1 {
				name := fmt.Sprintf("gone-%d.example.com", i)
				ds = append(ds, handed(name, listening(t, dir, name)))
			}
			return inBatches(ds) // the fifth batch has one too many: the first four are kept
		}, "[abort]", 2, 4*batchDrivers - 2},
		{"as many others as it configures, without sockets", many(300), func(t *testing.T, dir string) []*Msg {
			var ds []*Driver
			for i := range 300 {
				ds = append(ds, handed(fmt.Sprintf("gone-%d.example.com", i)))
			}
			return inBatches(ds)
		}, "[ack]", 0, 0},
		{"one more than it configures, without sockets", many(300), func(t *testing.T, dir string) []*Msg {
			var ds []*Driver
			for i := range 301 {
				ds = append(ds, handed(fmt.Sprintf("gone-%d.example.com", i)))
			}
			return inBatches(ds)
		}, "[abort]", 0, 0},
		{"a driver with three sockets", own, func(t *testing.T, dir string) []*Msg {
			return inBatches([]*Driver{handed("a.example.com", listening(t, dir, "a"), listening(t, dir, "a2"), listening(t, dir, "a3"))})
		}, "[abort]", 0, 0},
		{"a batch without drivers before the last", own, func(t *testing.T, dir string) []*Msg {
			first := inBatches([]*Driver{handed("a.example.com", listening(t, dir, "a"))})[0]
			first.Last, first.Lock = false, false
			return []*Msg{first, {Type: MsgBatch, Version: 1}, inBatches(nil)[0]}
		}, "[abort]", 1, 0},
		{"more bytes", nil, func(t *testing.T, dir string) []*Msg {
			var ms []*Msg
			for i := range 40 { // 4 MiB for 256 drivers; 40 drivers of 140 KiB
				ms = append(ms, &Msg{Type: MsgBatch, Version: 1, Drivers: []*Driver{big(fmt.Sprintf("big-%d.example.com", i))}})
			}
			ms[len(ms)-1].Last, ms[len(ms)-1].Lock = true, true
			return ms
		}, "[abort]", 0, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			lock := lockedFile(t, dir)
			batches := tt.hand(t, dir)
			answers := holderSends(t, dir, lock, batches...)
			before := openFDs(t)
			var logs testkit.Buffer
			snap, got, err := Ask(dir, logs.Logger(), sameLockFile(dir), tt.own, nil)
			defer snap.Close()
			if got != nil {
				defer got.Close()
			}
			// The descriptors of what is not kept are closed at once.
			held := before + snap.Sockets()
			if got != nil {
				held++
			}
			testkit.Eventually(t, 5*time.Second, "no descriptor held beyond the snapshot's and the lock's", func() bool { return openFDs(t) <= held })
			if a := fmt.Sprint(<-answers); a != tt.want {
				t.Errorf("the new instance answered %s, want %s (Ask: %v)", a, tt.want, err)
			}
			configured, retired := 0, 0
			for _, name := range tt.own {
				if hd := snap.Take(name); hd != nil {
					configured++
					hd.Close()
				}
			}
			for _, hd := range snap.TakeAll() {
				retired++
				if hd.Spec.Type != "" || hd.Status.Phase != "" || len(hd.Sockets) == 0 {
					t.Errorf("%s: kept %+v, want its name and sockets alone", hd.Spec.Name, hd)
				}
				for _, hs := range hd.Sockets {
					if err := hs.Check(); err != nil {
						t.Errorf("%s: %v", hs.Path, err)
					}
				}
				hd.Close()
			}
			if configured != tt.configured || retired != tt.retired {
				t.Errorf("kept %d drivers whole and %d for their sockets, want %d and %d", configured, retired, tt.configured, tt.retired)
			}
			// Every descriptor received is closed once the snapshot's are: none was kept beyond it.
			if got != nil {
				got.Close()
				got = nil
			}
			testkit.Eventually(t, 5*time.Second, "every descriptor received closed", func() bool { return openFDs(t) <= before })
			if n := strings.Count(logs.String(), "\n"); n > 2 {
				t.Errorf("%d log lines, want a summary:\n%s", n, logs.String())
			}
		})
	}
}
