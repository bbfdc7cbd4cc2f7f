package registrar

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/testkit"
)

// TestInheritBoundsTheHandedRetry: a driver handed over as backing off until
// 2099 is tried again within its own backoff's longest wait, not parked until then.
func TestInheritBoundsTheHandedRetry(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := handoverDrivers(t, dir)[1] // the device plugin; backoff up to 200 ms
	st, _ := json.Marshal(DriverStatus{Phase: BackingOff, Failures: 9, NextAttempt: time.Date(2099, 1, 1, 0, 0, 0, 0, time.UTC)})
	snap := &handover.Snapshot{}
	snap.Add(&handover.Driver{Spec: d, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, Status: st, Failures: 9})
	s := runSupervisor(t, Options{})
	s.Inherit(snap)
	start := time.Now()
	s.Start(d)
	if next := statusOf(s, d.Name).NextAttempt; next.After(start.Add(time.Second)) {
		t.Errorf("next attempt %s, want within the backoff's 200 ms (randomized)", next)
	}
	awaitSocket(t, d)
	registerAndWait(t, s, d)
}

// TestInheritRefusesADescriptorBoundElsewhere: a predecessor that hands a
// listener bound elsewhere for a path where a dead socket has the identity it claims does not
// get a dead socket reported Registered: the loop publishes its own socket there.
func TestInheritRefusesADescriptorBoundElsewhere(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := handoverDrivers(t, dir)[1] // the device plugin
	if err := os.MkdirAll(filepath.Dir(d.SocketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	dead, err := testkit.ListenUnlinked(d.SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	id := mustID(t, d.SocketPath)
	dead.Close() // the file stays, and nothing listens on it
	elsewhere, err := testkit.ListenUnlinked(filepath.Join(dir, "elsewhere.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer elsewhere.Close()
	f, err := elsewhere.File()
	if err != nil {
		t.Fatal(err)
	}
	snap := handedRegistered(d, id, f)
	s := runSupervisor(t, Options{})
	s.Inherit(snap)
	s.Start(d)
	if n := s.Adopted(); n != 0 {
		t.Fatalf("%d sockets taken over, want none: the descriptor is not the socket at %s", n, d.SocketPath)
	}
	testkit.Eventually(t, 5*time.Second, "a socket of the loop's own", func() bool {
		now, _, err := fsid.Stat(d.SocketPath)
		return err == nil && now != id
	})
	registerAndWait(t, s, d)
}
