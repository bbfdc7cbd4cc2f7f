package regdir

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/testkit"
)

// idleHolder is a holder with no drivers: what a multireg whose file lists none hands over.
type idleHolder struct{}

func (idleHolder) HandOver() *handover.Snapshot    { return &handover.Snapshot{} }
func (idleHolder) Resume(s *handover.Snapshot)     { s.Close() }
func (idleHolder) Release([]handover.ListenerSpec) {}

// TestDirServesRequestsConcurrently: the requests being served are the Dir's
// own: more silent ones than are served at once wait in the kernel's queue, and Close ends
// those being served at once, rather than after their hello's timeout, and waits for them.
func TestDirServesRequestsConcurrently(t *testing.T) {
	dir := filepath.Join(testkit.ShortDir(t), "reg")
	d := openDirWith(t, dir, Options{Handover: handover.Timeouts{Hello: time.Minute}})
	d.Record(&config.RegistrarConfig{RegistrationDir: dir}) // applied: requests are served from now on
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- d.Run(ctx, idleHolder{}) }()

	for range maxRequests + 10 {
		hc, err := handover.Dial(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer hc.Close()
	}
	inflight := func() int {
		d.reqMu.Lock()
		defer d.reqMu.Unlock()
		return len(d.inflight)
	}
	testkit.Eventually(t, 5*time.Second, "every slot taken by a silent request", func() bool { return inflight() == maxRequests })
	testkit.Never(t, 200*time.Millisecond, "more requests served at once than maxRequests", func() bool { return inflight() > maxRequests })

	cancel()
	if err := <-ran; err != nil {
		t.Errorf("Run: %v", err)
	}
	closed := make(chan struct{})
	go func() {
		d.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close waits for the silent requests' hello timeout (a minute)")
	}
	if n := inflight(); n != 0 {
		t.Errorf("%d requests still served after Close", n)
	}
}
