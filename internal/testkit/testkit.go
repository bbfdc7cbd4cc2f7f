// Package testkit holds the helpers the tests of every package share: a log buffer that a
// process and a test read and write at once, and polling with a deadline (a test waits for a
// condition, never for a time).
package testkit

import (
	"bytes"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// Buffer is a bytes.Buffer safe for concurrent writers and readers: a logger writes to it
// while the test reads it.
type Buffer struct {
	// guards: b.
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Len returns how many bytes were written so far.
func (s *Buffer) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Len()
}

// Logger returns a text logger writing to the buffer, debug level included.
func (s *Buffer) Logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(s, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// ShortDir returns a temporary directory with a short path, removed when the test ends: unix
// socket paths are limited to 107 bytes, and t.TempDir's are long.
func ShortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// Eventually polls cond until it holds, and fails the test when timeout passes first.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// Never checks for d that cond does not become true: an assertion of absence. It fails the
// test with what when cond holds.
func Never(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.NewTimer(d)
	defer end.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-end.C:
			return
		case <-tick.C:
			if cond() {
				t.Fatalf("%s", what)
			}
		}
	}
}

// Logger returns a logger that logs through t at debug level, so that a failing test shows
// what happened.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(writer{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type writer struct{ t testing.TB }

func (w writer) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimSuffix(p, []byte("\n"))))
	return len(p), nil
}

// IsSocket reports whether a socket is at path (not following a symlink).
func IsSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == fs.ModeSocket
}

// ListenUnlinked listens on a unix socket at path that stays when the listener closes.
func ListenUnlinked(path string) (*net.UnixListener, error) {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	return l, nil
}
