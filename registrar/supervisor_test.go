package registrar

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// inotifyInstances counts this process's inotify file descriptors.
func inotifyInstances(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// TestManyDriversShareOneWatcher runs more drivers than Linux's default limit of 128 inotify
// instances per user: they must share one.
func TestManyDriversShareOneWatcher(t *testing.T) {
	dir := testkit.ShortDir(t)
	before := inotifyInstances(t)
	s := runSupervisor(t, Options{})
	const n = 150
	var drivers []config.Driver
	for i := range n {
		d := testDriver(dir, fmt.Sprintf("vendor.example/dev%d", i), config.DevicePlugin, filepath.Join(dir, "ep", fmt.Sprintf("d%d.sock", i)))
		d.WaitForEndpoint = false
		drivers = append(drivers, d)
		s.Start(d)
	}
	testkit.Eventually(t, 30*time.Second, "every socket", func() bool {
		for _, d := range drivers {
			if !testkit.IsSocket(d.SocketPath) {
				return false
			}
		}
		return true
	})
	if got := inotifyInstances(t) - before; got != 1 {
		t.Errorf("%d drivers use %d inotify instances, want 1", n, got)
	}
	if got := len(s.Status()); got != n {
		t.Errorf("status lists %d drivers, want %d", got, n)
	}
}

// TestHungEndpointDoesNotDelayOthers: a CSI endpoint that accepts connections but never
// answers keeps only its own driver waiting.
func TestHungEndpointDoesNotDelayOthers(t *testing.T) {
	dir := testkit.ShortDir(t)
	hungPath := filepath.Join(dir, "hung", "csi.sock")
	if err := os.MkdirAll(filepath.Dir(hungPath), 0o755); err != nil {
		t.Fatal(err)
	}
	hung, err := net.Listen("unix", hungPath) // never accepts: the kernel completes connects, nobody answers
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	hd := testDriver(dir, "hung.csi.k8s.io", config.CSIPlugin, hungPath)

	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	ok := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)

	s := runSupervisor(t, Options{})
	s.Start(hd)
	s.Start(ok)
	testkit.Eventually(t, 5*time.Second, "the healthy driver's socket", func() bool { return testkit.IsSocket(ok.SocketPath) })
	register(t, ok.SocketPath, true, "")
	testkit.Eventually(t, 5*time.Second, "the healthy driver registered", func() bool { return statusOf(s, ok.Name).Phase == Registered })
	testkit.Eventually(t, 5*time.Second, "the hung driver's probe to time out", func() bool {
		st := statusOf(s, hd.Name)
		return st.Phase == WaitingForEndpoint && strings.Contains(st.LastError, "GetPluginInfo")
	})
	if testkit.IsSocket(hd.SocketPath) {
		t.Error("a socket was published for a hung endpoint")
	}
}

// TestConcurrentStartsOfOneName: concurrent restarts of one driver leave exactly one loop,
// which Stop stops.
func TestConcurrentStartsOfOneName(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() { s.Start(d) })
	}
	wg.Wait()
	awaitSocket(t, d)
	s.Stop(d.Name)
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Fatalf("socket after Stop: %v", err)
	}
	testkit.Never(t, time.Second, "a loop survived Stop and published again", func() bool {
		_, err := os.Lstat(d.SocketPath)
		return err == nil
	})
}

func TestStopRemovesSocketShutdownKeepsIt(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	a := testDriver(dir, "vendor.example/a", config.DevicePlugin, ep)
	b := testDriver(dir, "vendor.example/b", config.DevicePlugin, ep)

	s, err := New(Options{Log: testkit.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	s.Start(a)
	s.Start(b)
	testkit.Eventually(t, 5*time.Second, "both sockets", func() bool { return testkit.IsSocket(a.SocketPath) && testkit.IsSocket(b.SocketPath) })

	s.Stop(a.Name) // blocks until the loop has exited
	if _, err := os.Lstat(a.SocketPath); !os.IsNotExist(err) {
		t.Errorf("socket of a stopped driver: %v, want removed", err)
	}
	if len(s.Status()) != 1 {
		t.Errorf("status lists %d drivers after Stop, want 1", len(s.Status()))
	}
	s.Stop("unknown") // no-op

	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return within 5s")
	}
	if !testkit.IsSocket(b.SocketPath) {
		t.Error("shutdown removed a socket; it must stay so kubelet keeps the plugin")
	}
	s.Start(a) // after Run: nothing
	if len(s.Status()) != 0 {
		t.Error("Start after Run started a loop")
	}
}

func TestCleanupOnExitRemovesSockets(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	// A stale socket from an earlier run, never replaced because the endpoint is down.
	stale := testDriver(dir, "vendor.example/stale", config.DevicePlugin, filepath.Join(dir, "ep", "none.sock"))
	if err := os.MkdirAll(filepath.Dir(stale.SocketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	l, err := testkit.ListenUnlinked(stale.SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	l.Close() // the file stays, nothing listens: stale
	startEndpoint(t, ep, "")

	s, err := New(Options{Log: testkit.Logger(t), CleanupOnExit: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	s.Start(d)
	s.Start(stale)
	awaitSocket(t, d)
	cancel()
	<-done
	for _, p := range []string{d.SocketPath, stale.SocketPath} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s after shutdown with cleanup: %v, want removed", p, err)
		}
	}
}
