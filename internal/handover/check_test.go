package handover

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// handedSocket is what a predecessor hands for path: the listener l's descriptor, claimed to be
// the socket with the identity of the file now at path.
func handedSocket(t *testing.T, l *net.UnixListener, path string) *Socket {
	t.Helper()
	f, err := l.File()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	id, _, err := fsid.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return &Socket{Path: path, ID: id, File: f}
}

// TestCheckNeedsTheSocketBoundAtThePath: a handed descriptor is served only if
// it is the socket bound at its path — not merely a listening socket while the file at the
// path has the identity the predecessor claims. A socket published by rename (bound at a
// temporary name) passes, and so does one while kubelet's connection waits on it.
func TestCheckNeedsTheSocketBoundAtThePath(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg, other := filepath.Join(dir, "reg"), filepath.Join(dir, "other")
	for _, d := range []string{reg, other} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	published := func(name string) *net.UnixListener {
		l, _, err := sockfile.Publish(filepath.Join(reg, name), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	elsewhere, err := testkit.ListenUnlinked(filepath.Join(other, "x.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer elsewhere.Close()

	// The real thing: published by rename, and kubelet's connection queued before the check.
	good := published("good-reg.sock")
	kubelet, err := net.Dial("unix", filepath.Join(reg, "good-reg.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer kubelet.Close()
	if err := handedSocket(t, good, filepath.Join(reg, "good-reg.sock")).Check(); err != nil {
		t.Errorf("the socket bound at its path: %v", err)
	}

	// A listener bound elsewhere, for a path where another listening socket is, and for one
	// where a dead socket is; with no connection waiting on it, and with one.
	published("live-reg.sock")
	live := filepath.Join(reg, "live-reg.sock")
	dead := filepath.Join(reg, "dead-reg.sock")
	l, err := testkit.ListenUnlinked(dead)
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	for _, waiting := range []bool{false, true} {
		if waiting {
			q, err := net.Dial("unix", filepath.Join(other, "x.sock"))
			if err != nil {
				t.Fatal(err)
			}
			defer q.Close()
		}
		for _, p := range []string{live, dead} {
			if err := handedSocket(t, elsewhere, p).Check(); err == nil || !strings.Contains(err.Error(), p) {
				t.Errorf("a listener bound elsewhere, for %s (connection waiting: %v): %v, want an error naming the path", p, waiting, err)
			}
		}
	}

	// The checked listener still has kubelet's connection, alive, and accepts the next.
	if _, err := kubelet.Write([]byte("k")); err != nil {
		t.Fatal(err)
	}
	a, err := good.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := a.Read(make([]byte, 1)); err != nil {
		t.Errorf("kubelet's connection, waiting during the check: %v", err)
	}
	c, err := net.Dial("unix", filepath.Join(reg, "good-reg.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for range 2 { // the check's own connection, left in the queue, then this one
		a, err := good.Accept()
		if err != nil {
			t.Fatal(err)
		}
		a.Close()
	}
}

// TestCheckSaysANonSocketOnce: a descriptor handed for a socket that is not one (a regular file,
// a pipe) fails the check, which says why once, not once per socket option it reads.
func TestCheckSaysANonSocketOnce(t *testing.T) {
	dir := testkit.ShortDir(t)
	path := filepath.Join(dir, "x-reg.sock")
	l, err := testkit.ListenUnlinked(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	file, err := os.CreateTemp(dir, "file")
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for _, f := range []*os.File{file, r} {
		hs := handedSocket(t, l, path)
		hs.File = f
		err := hs.Check()
		if err == nil {
			t.Fatalf("%s: taken for a socket", f.Name())
		}
		if n := strings.Count(err.Error(), "socket operation on non-socket"); n != 1 {
			t.Errorf("%s: %q says %d times why, want once", f.Name(), err, n)
		}
	}
}
