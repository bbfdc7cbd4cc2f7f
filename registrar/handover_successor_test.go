package registrar

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

// A successor that misbehaves, seen from the holder.

// takeEverything plays a successor that speaks hand-over version v: it says hello (and take,
// after the welcome, from version 2 on), takes every batch and the lock's descriptor, and then
// says nothing. It returns the descriptors it holds (closed when the test ends) and when it
// said the word that paused the holder.
func takeEverything(t *testing.T, reg string, v int) ([]*os.File, time.Time) {
	t.Helper()
	hc := sayHello(t, reg, v)
	paused := time.Now()
	var kept []*os.File
	t.Cleanup(func() { handover.CloseAll(kept) })
	for {
		m, files, err := hc.Recv()
		if err != nil {
			t.Fatal(err)
		}
		kept = append(kept, files...)
		switch {
		case m.Type == handover.MsgWelcome:
			paused = time.Now()
			if err := hc.Send(&handover.Msg{Type: handover.MsgTake, Version: m.Version}); err != nil {
				t.Fatal(err)
			}
		case m.Last:
			return kept, paused
		}
	}
}

// sayHello asks reg's holder for a hand-over in version v, and says nothing more. The
// connection is closed when the test ends.
func sayHello(t *testing.T, reg string, v int) handover.Conn {
	t.Helper()
	hc, err := handover.Dial(reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hc.Close() })
	if err := hc.Send(&handover.Msg{Type: handover.MsgHello, MinVersion: v, Version: v}); err != nil {
		t.Fatal(err)
	}
	return hc
}

// heldByAnother reports whether another open of reg's lock file cannot be locked: some
// instance holds the directory.
func heldByAnother(t *testing.T, reg string) bool {
	t.Helper()
	f, err := os.Open(filepath.Join(reg, regdir.LockName))
	if err != nil {
		return false
	}
	defer f.Close()
	return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == syscall.EWOULDBLOCK
}

// servingAll reports whether in's loops serve every driver of ds, Registered.
func servingAll(in *multiregInstance, ds []string) bool {
	for _, name := range ds {
		if statusOf(in.sup, name).Phase != Registered {
			return false
		}
	}
	return true
}

// TestHandOverUnackedKeepsServing: a successor that takes every socket and the
// lock's descriptor and never acknowledges does not keep the directory: the holder never let
// go of its lock, serves every socket again within the pause timeout, and a real hand-over works
// after.
func TestHandOverUnackedKeepsServing(t *testing.T) {
	for _, v := range []int{1, 2} {
		t.Run(fmt.Sprintf("version %d", v), func(t *testing.T) { unackedKeepsServing(t, v) })
	}
}

func unackedKeepsServing(t *testing.T, v int) {
	reg, ds, a, before := registeredMultireg(t)
	var names []string
	for _, d := range ds {
		names = append(names, d.Name)
	}
	kept, hello := takeEverything(t, reg, v)
	if len(kept) != len(ds)+1 {
		t.Fatalf("%d descriptors taken, want %d sockets and the lock", len(kept), len(ds))
	}
	testkit.Eventually(t, handover.DefaultPauseTimeout+2*time.Second, "the holder to serve every driver again", func() bool {
		return servingAll(a, names)
	})
	t.Logf("the holder serves again %s after the hello", time.Since(hello).Round(time.Millisecond))
	for _, d := range ds {
		if info := dialKubelet(t, d.SocketPath).GetInfo(t); info.Name != d.Name {
			t.Errorf("%s: GetInfo says %q", d.Name, info.Name)
		}
	}
	if err := a.dir.Check(); err != nil {
		t.Errorf("the holder lost the directory: %v", err)
	}
	if !heldByAnother(t, reg) {
		t.Error("nobody holds the directory's lock: a third instance could take it")
	}
	if now := ids(t, ds); len(now) != len(before) {
		t.Errorf("sockets %v, were %v", now, before)
	}
	select {
	case err := <-a.ran:
		t.Fatalf("the holder's Run returned %v: it serves nothing", err)
	default:
	}
	handover.CloseAll(kept)
	b := startMultireg(t, reg, ds)
	if n := a.handedOver(t); n != len(ds) || b.sup.TakenOver() != len(ds) {
		t.Errorf("the hand-over after it: %d sockets kept, %d taken over, want %d", n, b.sup.TakenOver(), len(ds))
	}
}

// TestHandOverRequestsDoNotDelayTheLockCheck: hundreds of silent hand-over
// requests neither delay the holder's check of its lock (a removed lock file is made again
// within the check's period) nor keep a real successor from its hand-over.
func TestHandOverRequestsDoNotDelayTheLockCheck(t *testing.T) {
	reg, ds, a, _ := registeredMultireg(t)
	const silent = 1000
	for range silent {
		hc, err := handover.Dial(reg)
		if err != nil {
			t.Fatal(err)
		}
		defer hc.Close()
	}
	lock := filepath.Join(reg, regdir.LockName)
	if err := os.Remove(lock); err != nil {
		t.Fatal(err)
	}
	removed := time.Now()
	testkit.Eventually(t, 3*time.Second, "the holder to make its lock file again", func() bool { return isFile(lock) && heldByAnother(t, reg) })
	t.Logf("lock file made again %s after its removal, %d silent requests pending", time.Since(removed).Round(time.Millisecond), silent)

	asked := time.Now()
	b := startMultireg(t, reg, ds)
	if n := a.handedOver(t); n != len(ds) || b.sup.TakenOver() != len(ds) {
		t.Errorf("the hand-over among %d silent requests: %d sockets kept, %d taken over, want %d", silent, n, b.sup.TakenOver(), len(ds))
	}
	t.Logf("handed over %s after the successor asked", time.Since(asked).Round(time.Millisecond))
}

// isFile reports whether a file is at path.
func isFile(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// TestHandOverHelloAlonePausesNothing: a successor that says hello and then
// nothing pauses nothing: the holder welcomes it, waits the hello timeout for its take with every
// loop running, and gives up.
func TestHandOverHelloAlonePausesNothing(t *testing.T) {
	var logs testkit.Buffer
	reg, ds, a, _ := registeredMultiregLog(t, logs.Logger())
	hc := sayHello(t, reg, 2)
	if m, _, err := hc.Recv(); err != nil || m.Type != handover.MsgWelcome || m.Version != 2 {
		t.Fatalf("the holder's answer to a hello: %+v, %v; want a welcome in version 2", m, err)
	}
	testkit.Eventually(t, handover.DefaultHelloTimeout+5*time.Second, "the holder to give up on the silent successor", func() bool {
		return strings.Contains(logs.String(), "hand-over request abandoned before it paused anything")
	})
	if out := logs.String(); strings.Contains(out, "handing over the registration directory") {
		t.Errorf("the holder stopped its loops for a hello alone:\n%s", out)
	}
	for _, d := range ds {
		if info := dialKubelet(t, d.SocketPath).GetInfo(t); info.Name != d.Name {
			t.Errorf("%s: GetInfo says %q", d.Name, info.Name)
		}
		if st := statusOf(a.sup, d.Name); st.Phase != Registered {
			t.Errorf("%s: %s, want Registered", d.Name, st.Phase)
		}
	}
	if err := a.dir.Check(); err != nil {
		t.Errorf("the holder lost the directory: %v", err)
	}
}

// TestHandOverVersion1HelloPausesLittle: in version 1 (v0.1.0's), which has no
// take, a successor that says hello and then nothing pauses the holder's sockets for
// the pause timeout at most: a connection kubelet makes meanwhile is accepted within it.
func TestHandOverVersion1HelloPausesLittle(t *testing.T) {
	var logs testkit.Buffer
	reg, ds, a, _ := registeredMultiregLog(t, logs.Logger())
	sayHello(t, reg, 1)
	hello := time.Now()
	testkit.Eventually(t, 5*time.Second, "the holder's loops to stop for the hand-over", func() bool {
		return strings.Contains(logs.String(), "handing over the registration directory")
	})
	c, err := net.Dial("unix", ds[0].SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	connected := time.Now()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != nil { // the server's HTTP/2 settings, once accepted
		t.Fatalf("no answer on %s: %v", ds[0].SocketPath, err)
	}
	waited := time.Since(connected)
	t.Logf("a connection made during the pause accepted after %s; the pause ended %s after the hello", waited.Round(time.Millisecond), time.Since(hello).Round(time.Millisecond))
	if waited > handover.DefaultPauseTimeout+time.Second {
		t.Errorf("a connection waited %s to be accepted, want at most the pause timeout (%s)", waited, handover.DefaultPauseTimeout)
	}
	var names []string
	for _, d := range ds {
		names = append(names, d.Name)
	}
	testkit.Eventually(t, 5*time.Second, "the holder to serve every driver again", func() bool { return servingAll(a, names) })
}

// TestHandOverRequestMessages: a request of the wrong type is logged with what
// it was, not err=<nil>; no message names the hand-over socket's temporary name; and many
// requests that are not hand-overs make one warning, not one each.
func TestHandOverRequestMessages(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	ds := handoverDrivers(t, dir)
	var logs testkit.Buffer
	startMultiregLog(t, reg, ds, logs.Logger())
	for _, d := range ds {
		awaitSocket(t, d)
	}
	const requests = 50
	for i := range requests {
		hc, err := handover.Dial(reg)
		if err != nil {
			t.Fatal(err)
		}
		typ := handover.MsgAck
		if i%2 == 1 {
			typ = handover.MsgReleased
		}
		if err := hc.Send(&handover.Msg{Type: typ, Version: 1}); err != nil {
			t.Fatal(err)
		}
		hc.Recv() // the holder closes the connection
		hc.Close()
	}
	silent, err := handover.Dial(reg) // says nothing: the holder gives up on it after the hello timeout
	if err != nil {
		t.Fatal(err)
	}
	silent.Recv()
	silent.Close()
	testkit.Eventually(t, 5*time.Second, "the requests logged", func() bool {
		return strings.Count(logs.String(), "hand-over request not understood") == requests+1
	})
	out := logs.String()
	if strings.Contains(out, "err=<nil>") || !strings.Contains(out, `a \"ack\" message where a hello belongs`) {
		t.Errorf("a request of the wrong type is not logged with its type:\n%s", out)
	}
	if strings.Contains(out, ".mr-") {
		t.Errorf("a message names a temporary socket:\n%s", out)
	}
	if n := strings.Count(out, "level=WARN msg=\"hand-over request not understood"); n != 1 {
		t.Errorf("%d warnings for %d requests that are not hand-overs, want 1 (the rest at debug level)", n, requests+1)
	}
}
