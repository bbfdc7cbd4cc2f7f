package registrar

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/handover"
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

// loopEnds is a log handler that records, in order, the end of every loop that removes its
// socket (a supervisor with CleanupOnExit) and the marks a test sets.
type loopEnds struct {
	mu     sync.Mutex
	events []string
}

func (*loopEnds) Enabled(context.Context, slog.Level) bool { return true }

func (e *loopEnds) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "registration socket removed; kubelet deregisters the plugin" {
		e.mark("a loop ended")
	}
	return nil
}

func (e *loopEnds) WithAttrs([]slog.Attr) slog.Handler { return e }
func (e *loopEnds) WithGroup(string) slog.Handler      { return e }

func (e *loopEnds) mark(what string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.events = append(e.events, what)
}

// endedAfter reports whether a loop ended after the mark what.
func (e *loopEnds) endedAfter(what string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	marked := false
	for _, ev := range e.events {
		switch {
		case ev == what:
			marked = true
		case marked:
			return true
		}
	}
	return false
}

// TestStartRacingShutdownRunsNoLoopAfterRun: a Start that races Run's shutdown either starts
// a loop that Run waits for, or none: no loop runs once Run has returned (nor does the race
// panic, reusing the loops' WaitGroup).
func TestStartRacingShutdownRunsNoLoopAfterRun(t *testing.T) {
	dir := testkit.ShortDir(t)
	const rounds = 300
	logs := make([]*loopEnds, rounds)
	for i := range rounds {
		d := testDriver(filepath.Join(dir, fmt.Sprint(i)), "vendor.example/gpu", config.DevicePlugin, filepath.Join(dir, "ep", "none.sock"))
		d.WaitForEndpoint = false
		logs[i] = &loopEnds{}
		s, err := New(Options{Log: slog.New(logs[i]), CleanupOnExit: true})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan struct{})
		go func() {
			defer close(ran)
			s.Run(ctx)
			logs[i].mark("Run returned")
		}()
		started := make(chan struct{})
		go func() {
			defer close(started)
			s.Start(d)
		}()
		cancel()
		<-ran
		<-started
		if len(s.Status()) != 0 {
			t.Fatal("a driver is listed after Run returned")
		}
	}
	// A loop that outlived Run ends at once (its context has ended): every round is looked at
	// once all have run.
	for i, l := range logs {
		if l.endedAfter("Run returned") {
			t.Fatalf("round %d: a loop ended after Run had returned", i)
		}
	}
}

// paused runs a supervisor with driver a, paused (as for a hand-over), and b, a driver it
// does not run. The supervisor runs until the test ends.
func paused(t *testing.T) (s *Supervisor, a, b config.Driver, snap *handover.Snapshot) {
	t.Helper()
	dir := testkit.ShortDir(t)
	a = testDriver(dir, "vendor.example/a", config.DevicePlugin, filepath.Join(dir, "ep", "a.sock"))
	b = testDriver(dir, "vendor.example/b", config.DevicePlugin, filepath.Join(dir, "ep", "b.sock"))
	a.WaitForEndpoint, b.WaitForEndpoint = false, false
	s = runSupervisor(t, Options{})
	s.Start(a)
	awaitSocket(t, a)
	snap = s.HandOver()
	t.Cleanup(func() { snap.Close() })
	if snap.Len() != 1 {
		t.Fatalf("HandOver handed over %d drivers, want 1", snap.Len())
	}
	return s, a, b, snap
}

// returned reports whether done is closed.
func returned(done <-chan struct{}) func() bool {
	return func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	}
}

// TestHandOverHoldsStartUntilResume: a Start during a hand-over's pause waits until Resume has
// run the paused loops again, then runs its own.
func TestHandOverHoldsStartUntilResume(t *testing.T) {
	s, a, b, snap := paused(t)
	started := make(chan struct{})
	go func() {
		defer close(started)
		s.Start(b)
	}()
	testkit.Never(t, 300*time.Millisecond, "Start returned during a hand-over's pause", returned(started))
	if testkit.IsSocket(b.SocketPath) {
		t.Fatal("a driver started during a hand-over's pause published its socket")
	}
	s.Resume(snap)
	testkit.Eventually(t, 5*time.Second, "Start returned after Resume", returned(started))
	awaitSocket(t, b)
	if got := len(s.Status()); got != 2 {
		t.Errorf("status lists %d drivers after Resume and Start, want 2 (%s and %s)", got, a.Name, b.Name)
	}
}

// TestReleaseEndsTheCallsWaitingOnHandOver: the calls waiting on a hand-over's pause return
// once it succeeded (Release), and change nothing: the sockets are the next instance's.
func TestReleaseEndsTheCallsWaitingOnHandOver(t *testing.T) {
	s, a, b, _ := paused(t)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.Start(b) })
	wg.Go(func() { s.Stop(a.Name) })
	wg.Go(func() { s.Update(a) })
	go func() {
		defer close(done)
		wg.Wait()
	}()
	testkit.Never(t, 300*time.Millisecond, "a call returned during a hand-over's pause", returned(done))
	s.Release(nil)
	testkit.Eventually(t, 5*time.Second, "Start, Stop and Update returned after Release", returned(done))
	if !testkit.IsSocket(a.SocketPath) {
		t.Error("a Stop waiting on the hand-over removed the socket handed over")
	}
	if testkit.IsSocket(b.SocketPath) {
		t.Error("a Start waiting on the hand-over published a socket after Release")
	}
	if got := len(s.Status()); got != 0 {
		t.Errorf("status lists %d drivers after Release, want 0", got)
	}
}

// TestRunEndingEndsTheCallsWaitingOnHandOver: once Run has returned, Start does nothing and
// Stop and Update return, also when they waited on a hand-over's pause that never ended.
func TestRunEndingEndsTheCallsWaitingOnHandOver(t *testing.T) {
	dir := testkit.ShortDir(t)
	a := testDriver(dir, "vendor.example/a", config.DevicePlugin, filepath.Join(dir, "ep", "a.sock"))
	b := testDriver(dir, "vendor.example/b", config.DevicePlugin, filepath.Join(dir, "ep", "b.sock"))
	a.WaitForEndpoint, b.WaitForEndpoint = false, false
	s, err := New(Options{Log: testkit.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		s.Run(ctx)
	}()
	s.Start(a)
	awaitSocket(t, a)
	snap := s.HandOver()
	defer snap.Close()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.Start(b) })
	wg.Go(func() { s.Stop(a.Name) })
	wg.Go(func() { s.Update(a) })
	go func() {
		defer close(done)
		wg.Wait()
	}()
	cancel()
	testkit.Eventually(t, 5*time.Second, "Run returned", returned(ran))
	testkit.Eventually(t, 5*time.Second, "Start, Stop and Update returned after Run", returned(done))
	if testkit.IsSocket(b.SocketPath) {
		t.Error("a Start after Run published a socket")
	}
	if !testkit.IsSocket(a.SocketPath) {
		t.Error("a Stop after Run removed a socket")
	}
}
