package registrar

import (
	"encoding/json"
	"testing"
	"time"

	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/testkit"
)

// TestInheritBoundsTheHandedRetry (issue 28, 7): a driver handed over as backing off until
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
