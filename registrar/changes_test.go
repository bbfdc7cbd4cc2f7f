package registrar

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestChangedTellsWhatAWatcherReads: Changed's channel closes when a driver starts, when its
// endpoint comes (its phase changes), when it goes (its presence), and when it stops; a
// watcher that reads Status after each close sees each of them.
func TestChangedTellsWhatAWatcherReads(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "dra.sock")
	d := testDriver(dir, "gpu.example.com", config.DRAPlugin, ep)
	s, err := New(Options{Log: testkit.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	defer func() { cancel(); <-done }()

	changed := s.Changed()
	// awaitChange waits for the channel to close and for Status to say what ok accepts,
	// taking a new channel after each close.
	awaitChange := func(what string, ok func([]DriverStatus) bool) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			select {
			case <-changed:
				changed = s.Changed()
				if ok(s.Status()) {
					return
				}
			case <-deadline:
				t.Fatalf("no change closed the channel with %s: %+v", what, s.Status())
			}
		}
	}
	s.Start(d)
	awaitChange("the driver started", func(st []DriverStatus) bool { return len(st) == 1 })
	served := startEndpoint(t, ep, "")
	awaitChange("the driver serving", func(st []DriverStatus) bool { return st[0].Phase == Serving && st[0].EndpointUp })
	served.Stop()
	awaitChange("the endpoint gone", func(st []DriverStatus) bool { return st[0].Absent })
	s.Stop(d.Name)
	awaitChange("the driver stopped", func(st []DriverStatus) bool { return len(st) == 0 })
}
