package registrar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/sockfile"
	"multireg.dev/multireg/internal/testkit"
)

// multiregInstance is one multireg of a hand-over test: its directory, its supervisor, and Run's
// result once it has returned.
type multiregInstance struct {
	dir *regdir.Dir
	sup *Supervisor
	// handed is how many drivers regdir.Open brought from a hand-over.
	handed int
	ran    chan error // Dir.Run's result
}

// handoverDrivers are a CSI driver, a device plugin and a DRA driver with their endpoints
// served, registering into dir/reg.
func handoverDrivers(t testing.TB, dir string) []config.Driver {
	var ds []config.Driver
	for _, typ := range []string{config.CSIPlugin, config.DevicePlugin, config.DRAPlugin} {
		n := fixtureDrivers[typ]
		d := testDriver(dir, n.name, typ, filepath.Join(dir, "ep", n.socket))
		csiName := ""
		if typ == config.CSIPlugin {
			csiName = d.Name
		}
		startEndpoint(t, d.LocalEndpoint, csiName)
		ds = append(ds, d)
	}
	return ds
}

// startMultireg takes the registration directory of ds as `multireg run` does, asking its
// holder for a hand-over, and starts ds on a supervisor that serves what it brought. Its
// Dir.Run serves hand-over requests until the test ends.
func startMultireg(t testing.TB, reg string, ds []config.Driver) *multiregInstance {
	t.Helper()
	return startMultiregLog(t, reg, ds, testkit.Logger(t))
}

// startMultiregLog is startMultireg logging to log.
func startMultiregLog(t testing.TB, reg string, ds []config.Driver, log *slog.Logger) *multiregInstance {
	t.Helper()
	cfg := &config.RegistrarConfig{RegistrationDir: reg, Drivers: ds}
	d, snap, err := regdir.Open(context.Background(), cfg, log, regdir.Options{Ask: true})
	if err != nil {
		t.Fatal(err)
	}
	in := &multiregInstance{dir: d, handed: snap.Len(), ran: make(chan error, 1)}
	in.sup = runSupervisor(t, Options{Log: log, Guard: d.Check})
	in.sup.TakeOver(snap)
	for _, dr := range ds {
		in.sup.Start(dr)
	}
	in.sup.DropUntaken()
	d.Record(cfg) // applied: hand-over requests are served from now on
	testkit.RunUntilEnd(t, func(ctx context.Context) { in.ran <- d.Run(ctx, in.sup) })
	t.Cleanup(func() { d.Close() })
	return in
}

// handedOver waits for the instance's Run to return after a hand-over, and returns how many
// sockets it kept copies of (which it closes).
func (in *multiregInstance) handedOver(t testing.TB) int {
	t.Helper()
	select {
	case err := <-in.ran:
		ho, ok := errors.AsType[*handover.HandedOver](err)
		if !ok {
			t.Fatalf("the holder's Run returned %v, want a hand-over", err)
		}
		defer ho.Snapshot.Close()
		return ho.Snapshot.Sockets()
	case <-time.After(10 * time.Second):
		t.Fatal("the holder's Run did not return after the hand-over")
	}
	return 0
}

// registeredMultireg starts the drivers of handoverDrivers on a first multireg, registered,
// and returns the registration directory, the drivers, the instance and its sockets' identities.
func registeredMultireg(t *testing.T) (string, []config.Driver, *multiregInstance, []fsid.ID) {
	t.Helper()
	return registeredMultiregLog(t, testkit.Logger(t))
}

// registeredMultiregLog is registeredMultireg, logging to log.
func registeredMultiregLog(t *testing.T, log *slog.Logger) (string, []config.Driver, *multiregInstance, []fsid.ID) {
	t.Helper()
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	ds := handoverDrivers(t, dir)
	a := startMultiregLog(t, reg, ds, log)
	for _, d := range ds {
		awaitSocket(t, d)
		registerAndWait(t, a.sup, d)
	}
	return reg, ds, a, ids(t, ds)
}

// ids returns the identity of each driver's registration socket.
func ids(t testing.TB, ds []config.Driver) []fsid.ID {
	var out []fsid.ID
	for _, d := range ds {
		out = append(out, mustID(t, d.SocketPath))
	}
	return out
}

// TestHandOverKeepsEverySocket: a second instance takes every registered socket over: the
// same files, served by it, each driver Registered at once; the first hands over and runs
// nothing.
func TestHandOverKeepsEverySocket(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)

	b := startMultireg(t, reg, ds)
	if b.handed != len(ds) {
		t.Fatalf("%d drivers handed over, want %d", b.handed, len(ds))
	}
	if n := a.handedOver(t); n != len(ds) {
		t.Errorf("the holder kept %d sockets, want %d", n, len(ds))
	}
	if n := len(a.sup.Status()); n != 0 {
		t.Errorf("the holder still runs %d loops", n)
	}
	if n := b.sup.TakenOver(); n != len(ds) {
		t.Errorf("%d sockets taken over, want %d", n, len(ds))
	}
	for _, d := range ds {
		testkit.Eventually(t, 5*time.Second, d.Name+" Registered in the new instance", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
		if st := statusOf(b.sup, d.Name); st.Attempts != 1 {
			t.Errorf("%s: %d attempts in the new instance, want the first instance's 1", d.Name, st.Attempts)
		}
		if info := dialKubelet(t, d.SocketPath).GetInfo(t); info.Name != d.Name {
			t.Errorf("%s: GetInfo says %q", d.Name, info.Name)
		}
	}
	if now := ids(t, ds); !slices.Equal(now, before) {
		t.Errorf("sockets replaced: %v, were %v", now, before)
	}
}

// oneDriverMultireg is an instance serving one driver's socket, not registered yet.
func oneDriverMultireg(t *testing.T) (reg string, ds []config.Driver, a *multiregInstance) {
	t.Helper()
	dir := testkit.ShortDir(t)
	reg = filepath.Join(dir, "reg")
	ds = handoverDrivers(t, dir)[:1]
	a = startMultireg(t, reg, ds)
	awaitSocket(t, ds[0])
	return reg, ds, a
}

// TestHandOverPendingVerdict: kubelet asked GetInfo of the first instance; its verdict, sent
// after the hand-over on a new connection, counts in the second.
func TestHandOverPendingVerdict(t *testing.T) {
	reg, ds, a := oneDriverMultireg(t)
	d := ds[0]
	dialKubelet(t, d.SocketPath).GetInfo(t) // kubelet registers the plugin meanwhile

	b := startMultireg(t, reg, ds)
	if b.sup.TakenOver() != 1 {
		t.Fatal("the socket was not taken over")
	}
	if st := statusOf(b.sup, d.Name); st.Phase != Serving {
		t.Fatalf("new instance: %s, want Serving: the verdict is pending", st.Phase)
	}
	dialKubelet(t, d.SocketPath).Notify(t, true, "") // a connection of its own
	testkit.Eventually(t, 5*time.Second, "the verdict counted", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
	if st := statusOf(b.sup, d.Name); st.Attempts != 1 || st.Results[ResultRegistered] != 1 {
		t.Errorf("%+v, want the one attempt, registered", st)
	}
	a.handedOver(t)
}

// TestHandOverVerdictDuringTheHandOver: kubelet's verdict, sent as the hand-over runs, counts
// in whichever instance reads it: the first, which hands the driver over registered, or the
// second, which may read it (on kubelet's new connection, the first having closed its own) as
// soon as it serves the socket, before the loop runs.
func TestHandOverVerdictDuringTheHandOver(t *testing.T) {
	reg, ds, a := oneDriverMultireg(t)
	d := ds[0]
	k := dialKubelet(t, d.SocketPath)
	k.GetInfo(t) // kubelet registers the plugin meanwhile; its verdict goes out as the hand-over runs
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		k.Notify(t, true, "")
	}()
	b := startMultireg(t, reg, ds)
	<-sent
	testkit.Eventually(t, 5*time.Second, "the verdict counted", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
	a.handedOver(t)
}

// TestHandOverChangedAndRemovedDrivers: a driver registered differently in the new instance
// gets a new socket; one the new instance no longer runs loses its socket; the others are
// kept.
func TestHandOverChangedAndRemovedDrivers(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)
	changed := ds[0]
	changed.SupportedVersions = []string{"1.0.0", "1.1.0"}
	removed := ds[2]

	b := startMultireg(t, reg, []config.Driver{changed, ds[1]})
	a.handedOver(t)
	testkit.Eventually(t, 5*time.Second, "the changed driver's new socket", func() bool {
		id, _, err := fsid.Stat(changed.SocketPath)
		return err == nil && id != before[0]
	})
	if testkit.IsSocket(removed.SocketPath) {
		t.Error("the socket of the driver no longer configured is still there")
	}
	if id := mustID(t, ds[1].SocketPath); id != before[1] {
		t.Error("the unchanged driver's socket was replaced")
	}
	if n := b.sup.TakenOver(); n != 1 {
		t.Errorf("%d sockets taken over, want 1", n)
	}
}

// TestHandOverAbandonedResumes: a new instance that receives everything and goes without its
// ack leaves the holder serving every socket again, registered, from where it stood.
func TestHandOverAbandonedResumes(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)

	hc, err := handover.Dial(reg)
	if err != nil {
		t.Fatal(err)
	}
	if err := hc.Send(&handover.Msg{Type: handover.MsgHello, MinVersion: 1, Version: 1}); err != nil {
		t.Fatal(err)
	}
	var got int
	for {
		m, files, err := hc.Recv()
		if err != nil {
			t.Fatal(err)
		}
		got += len(files)
		handover.CloseAll(files) // gone without a word: our copies of the sockets and of the lock with us
		if m.Last {
			break
		}
	}
	hc.Close()
	if got != len(ds)+1 {
		t.Errorf("%d descriptors received, want %d sockets and the lock", got, len(ds))
	}
	testkit.Eventually(t, 10*time.Second, "the holder to serve every driver again", func() bool {
		for _, d := range ds {
			if statusOf(a.sup, d.Name).Phase != Registered {
				return false
			}
		}
		return true
	})
	if err := a.dir.Check(); err != nil {
		t.Errorf("the holder lost the directory: %v", err)
	}
	for _, d := range ds {
		if info := dialKubelet(t, d.SocketPath).GetInfo(t); info.Name != d.Name {
			t.Errorf("%s: GetInfo says %q", d.Name, info.Name)
		}
	}
	if now := ids(t, ds); !slices.Equal(now, before) {
		t.Errorf("sockets replaced: %v, were %v", now, before)
	}
	select {
	case err := <-a.ran:
		t.Errorf("the holder's Run returned %v", err)
	default:
	}
}

// TestTakeOverRefusesAReplacedSocket: a handed-over descriptor whose socket is no longer the
// file at its path is not served; the loop publishes its own socket there.
func TestTakeOverRefusesAReplacedSocket(t *testing.T) {
	dir := testkit.ShortDir(t)
	ds := handoverDrivers(t, dir)
	d := ds[1] // the device plugin
	id, f := handedSocket(t, d)
	// Someone replaces the socket after it was handed over.
	l2, id2, err := sockfile.Publish(d.SocketPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	snap := handedRegistered(d, id, f)
	s := runSupervisor(t, Options{})
	s.TakeOver(snap)
	s.Start(d)
	if n := s.TakenOver(); n != 0 {
		t.Fatalf("%d sockets taken over, want none", n)
	}
	testkit.Eventually(t, 5*time.Second, "a socket of the loop's own", func() bool {
		now, _, err := fsid.Stat(d.SocketPath)
		return err == nil && now != id && now != id2
	})
	registerAndWait(t, s, d)
}

// TestHandOverHostileRequests: requests that are not a hand-over — garbage, a hello that
// never comes, a version nobody speaks, a connection that goes at once — change nothing: the
// holder serves every driver, its sockets untouched, and a real hand-over still works after.
func TestHandOverHostileRequests(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)
	for _, req := range []struct {
		name string
		send func(handover.Conn) error
	}{
		{"garbage", func(hc handover.Conn) error {
			_, err := hc.UnixConn().Write([]byte("GET / HTTP/1.1\r\n\r\n"))
			return err
		}},
		{"silence", func(handover.Conn) error { return nil }},
		{"unknown version", func(hc handover.Conn) error {
			return hc.Send(&handover.Msg{Type: handover.MsgHello, MinVersion: 7, Version: 9})
		}},
		{"an ack out of turn", func(hc handover.Conn) error { return hc.Send(&handover.Msg{Type: handover.MsgAck, Version: 1}) }},
	} {
		hc, err := handover.Dial(reg)
		if err != nil {
			t.Fatal(err)
		}
		hc = hc.WithStep(time.Second) // the wait for the answer to silence
		if err := req.send(hc); err != nil {
			t.Fatalf("%s: %v", req.name, err)
		}
		// Whatever the holder answers (a refusal, or nothing), it hands nothing over.
		m, files, _ := hc.Recv()
		handover.CloseAll(files)
		if len(files) > 0 || m != nil && m.Type != handover.MsgRefuse {
			t.Errorf("%s: the holder answered %+v with %d descriptors", req.name, m, len(files))
		}
		hc.Close()
	}
	for _, d := range ds {
		if st := statusOf(a.sup, d.Name); st.Phase != Registered {
			t.Errorf("%s: %s after the hostile requests", d.Name, st.Phase)
		}
	}
	if now := ids(t, ds); !slices.Equal(now, before) {
		t.Errorf("sockets replaced: %v, were %v", now, before)
	}
	b := startMultireg(t, reg, ds)
	if n := a.handedOver(t); n != len(ds) || b.sup.TakenOver() != len(ds) {
		t.Errorf("the hand-over after them: %d sockets kept, %d taken over, want %d", n, b.sup.TakenOver(), len(ds))
	}
}

// TestHandOverTakesALateVerdict: a verdict that reaches the loop as it stops for a hand-over is
// not lost: a registration is handed over as such, and a rejection withdraws the socket and
// hands over the backoff, as the loop would have.
func TestHandOverTakesALateVerdict(t *testing.T) {
	for _, registered := range []bool{true, false} {
		t.Run(fmt.Sprint("registered=", registered), func(t *testing.T) {
			dir := testkit.ShortDir(t)
			spec := handoverDrivers(t, dir)[1] // the device plugin
			l := bareLoop(t, spec)
			g, err := l.socks.publish(spec.SocketPath, nil, l.ep.at, l.ep.versions())
			if err != nil {
				t.Fatal(err)
			}
			l.cur, l.st = g, stAwaitingVerdict
			l.d.notify(regserver.Verdict{Gen: g.gen, Registered: registered, Msg: "no"})
			h := l.handOverState()
			defer h.Close()
			st := h.Status
			if registered {
				if len(h.Sockets) != 1 || !h.Sockets[0].Registered || st.Phase != string(Registered) || st.Results[ResultRegistered] != 1 {
					t.Errorf("handed %+v with %+v, want the socket registered", st, h.Sockets)
				}
				return
			}
			if len(h.Sockets) != 0 || testkit.IsSocket(spec.SocketPath) {
				t.Errorf("the rejected socket is handed over or still there: %+v", h.Sockets)
			}
			if st.Phase != string(BackingOff) || st.Failures != 1 || st.NextAttempt.IsZero() || h.Failures != 1 {
				t.Errorf("handed %+v (backoff failures %d), want BackingOff after one failure", st, h.Failures)
			}
		})
	}
}

// handedRegistered is the snapshot a predecessor hands over for d registered on its socket,
// claimed to be the one of identity id, with f as its descriptor.
func handedRegistered(d config.Driver, id fsid.ID, f *os.File) *handover.Snapshot {
	snap := &handover.Snapshot{}
	snap.Add(&handover.Driver{Spec: d, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, Status: handedStatus(DriverStatus{Phase: Registered}),
		Sockets: []*handover.Socket{{Path: d.SocketPath, ID: id, Generation: 1, Registered: true, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, File: f}}})
	return snap
}
