package handover

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
	return &Socket{Path: path, ID: ToWire(id), File: f}
}

// TestCheckNeedsTheSocketBoundAtThePath (issue 28, 4): a handed descriptor is served only if
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

	// A listener bound elsewhere, for a path where another listening socket is.
	published("live-reg.sock")
	live := filepath.Join(reg, "live-reg.sock")
	if err := handedSocket(t, elsewhere, live).Check(); err == nil || !strings.Contains(err.Error(), live) {
		t.Errorf("a listener bound elsewhere, for %s (listening): %v, want an error naming the path", live, err)
	}

	// A listener bound elsewhere, for a path where a dead socket is.
	dead := filepath.Join(reg, "dead-reg.sock")
	l, err := testkit.ListenUnlinked(dead)
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	if err := handedSocket(t, elsewhere, dead).Check(); err == nil || !strings.Contains(err.Error(), dead) {
		t.Errorf("a listener bound elsewhere, for %s (dead): %v, want an error naming the path", dead, err)
	}

	// The listener that was checked still accepts: a connection after the check reaches it.
	c, err := net.Dial("unix", filepath.Join(reg, "good-reg.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := good.Accept()
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
}
