package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"multireg.dev/multireg/e2e/kubelet"
)

// attacker keeps connections to the registration sockets open, each doing its kind of harm.
type attacker struct {
	kind   string
	size   int
	socks  []string
	opened atomic.Int64
	closed atomic.Int64
}

// hold keeps connection i open until ctx ends, opening it again whenever multireg closes it.
func (a *attacker) hold(ctx context.Context, i int) {
	sock := a.socks[i%len(a.socks)]
	for ctx.Err() == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			// The socket is being recreated, or the backlog is full: try again shortly.
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		a.opened.Add(1)
		stop := context.AfterFunc(ctx, func() { c.Close() })
		if err := a.harm(c); err == nil {
			// Wait for multireg to close it, reading (and dropping) what it sends.
			_, _ = io.Copy(io.Discard, c) // until multireg closes it
		}
		stop()
		c.Close()
		if ctx.Err() == nil {
			a.closed.Add(1)
		}
	}
}

// harm sends what the kind of attack sends on c.
func (a *attacker) harm(c net.Conn) error {
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		return err
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		return err
	}
	if a.kind == "idle" {
		return nil
	}
	var b bytes.Buffer
	e := hpack.NewEncoder(&b)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", "/pluginregistration.Registration/NotifyRegistrationStatus"},
		{":authority", "localhost"}, {"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = e.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b.Bytes(), EndHeaders: true}); err != nil {
		return err
	}
	// The message's prefix and all but its last byte, in frames of 16 KiB at most, as the
	// server's flow-control windows allow: as a well-behaved client sends, so that the server
	// takes all of it.
	msg := make([]byte, 5+a.size-1)
	binary.BigEndian.PutUint32(msg[1:], uint32(a.size))
	w := newWindows()
	go w.read(fr)
	for len(msg) > 0 {
		n := w.take(min(len(msg), 16<<10))
		if n == 0 {
			return fmt.Errorf("connection closed")
		}
		if err := fr.WriteData(1, false, msg[:n]); err != nil {
			return err
		}
		msg = msg[n:]
	}
	w.drain() // the reader goes on reading until the connection closes
	return errHeld
}

// errHeld: harm's connection is being read by its windows' reader until it closes.
var errHeld = fmt.Errorf("held")

// windows follows the server's flow-control windows for stream 1 and the connection.
type windows struct {
	mu           sync.Mutex
	cond         *sync.Cond
	conn, stream int
	closed       bool
	done         chan struct{}
}

func newWindows() *windows {
	w := &windows{conn: 65535, stream: 65535, done: make(chan struct{})}
	w.cond = sync.NewCond(&w.mu)
	return w
}

// read reads the server's frames until the connection ends, opening the windows it opens.
func (w *windows) read(fr *http2.Framer) {
	defer close(w.done)
	for {
		f, err := fr.ReadFrame()
		w.mu.Lock()
		if err != nil {
			w.closed = true
			w.cond.Broadcast()
			w.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				w.conn += int(f.Increment)
			} else {
				w.stream += int(f.Increment)
			}
		case *http2.SettingsFrame:
			if v, ok := f.Value(http2.SettingInitialWindowSize); ok && !f.IsAck() {
				w.stream += int(v) - 65535
			}
		case *http2.RSTStreamFrame:
			w.closed = true
		case *http2.HeadersFrame:
			w.closed = w.closed || f.StreamEnded() // the call's status
		}
		w.cond.Broadcast()
		w.mu.Unlock()
	}
}

// take waits until n bytes (or fewer, at least 1) may be sent, and takes them; 0 once the
// connection or the stream is closed.
func (w *windows) take(n int) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	for !w.closed && (w.conn <= 0 || w.stream <= 0) {
		w.cond.Wait()
	}
	if w.closed {
		return 0
	}
	n = min(n, w.conn, w.stream)
	w.conn -= n
	w.stream -= n
	return n
}

// drain waits for the reader to end.
func (w *windows) drain() { <-w.done }

// watch samples multireg's RSS every 100 ms and, every 3 s, removes one driver's socket and
// times how long kubelet takes to register the socket multireg publishes again. It returns
// the peak RSS (KiB), the re-registration times, and whether multireg was alive at the end.
func watch(ctx context.Context, k *kubelet.Kubelet, pid int, reg string, names []string) (int, string, bool) {
	peak := 0
	var lat []string
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	next := time.Now().Add(3 * time.Second)
	victim, removed := 0, time.Time{}
	var before int
	for {
		select {
		case <-ctx.Done():
			if !removed.IsZero() {
				lat = append(lat, "not registered again before the attack ended")
			}
			return peak, strings.Join(lat, ", "), syscall.Kill(pid, 0) == nil
		case <-tick.C:
		}
		r := rss(pid)
		if r == 0 {
			return peak, strings.Join(lat, ", "), false
		}
		peak = max(peak, r)
		name := names[victim%len(names)]
		switch {
		case removed.IsZero() && time.Now().After(next):
			socks, _ := filepath.Glob(filepath.Join(reg, "*.sock"))
			before = len(k.EventsFor(name))
			for _, s := range socks {
				if strings.Contains(s, strings.ReplaceAll(name, "/", "_")) {
					if os.Remove(s) == nil {
						removed = time.Now()
					}
				}
			}
		case !removed.IsZero() && k.Registered(name) && len(k.EventsFor(name)) > before+1:
			lat = append(lat, time.Since(removed).Round(10*time.Millisecond).String())
			removed, victim, next = time.Time{}, victim+1, time.Now().Add(3*time.Second)
		}
	}
}

// rss returns pid's VmRSS in KiB; 0 when it is gone.
func rss(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// cgroupPeak returns the cgroup's memory.peak, or "-".
func cgroupPeak(cg string) string {
	if cg == "" {
		return "-"
	}
	peak, events := "memory.peak", "memory.events" // cgroup v2
	if _, err := os.Stat(filepath.Join(cg, peak)); err != nil {
		peak, events = "memory.max_usage_in_bytes", "memory.oom_control" // v1
	}
	b, err := os.ReadFile(filepath.Join(cg, peak))
	if err != nil {
		return "-"
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	ev, _ := os.ReadFile(filepath.Join(cg, events))
	return fmt.Sprintf("%d KiB (%s: %s)", n/1024, events, strings.Join(strings.Fields(string(ev)), " "))
}
