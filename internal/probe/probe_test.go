package probe

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestEndpointAnyPath: a CSI endpoint whose path holds bytes that mean something in a URL
// ('#', '%', '?', a space) is probed like any other: the path never becomes a gRPC target.
func TestEndpointAnyPath(t *testing.T) {
	dir := testkit.ShortDir(t)
	for _, name := range []string{"a#b", "a%25b", "a%zz", "a?b", "a b", "a #%25?b"} {
		ep := filepath.Join(dir, name, name+".sock")
		testkit.StartEndpoint(t, ep, "nfs.csi.k8s.io")
		d := config.Driver{Registration: config.Registration{Name: "nfs.csi.k8s.io", Type: config.CSIPlugin}, Local: config.Local{LocalEndpoint: ep}}
		if err := Endpoint(context.Background(), d); err != nil {
			t.Errorf("probe of %q: %v", ep, err)
		}
		d.Name = "smb.csi.k8s.io"
		if err := Endpoint(context.Background(), d); !errors.As(err, new(*NameMismatchError)) {
			t.Errorf("probe of %q under another name: %v, want a name mismatch", ep, err)
		}
	}
}

// TestProbeSlotsBound: no more calls run at once than there are slots; a call waiting for one
// gives up when its context ends; each call runs whole once it has its slot.
func TestProbeSlotsBound(t *testing.T) {
	slots := make(InFlight, 2)
	release := make(chan struct{})
	var running, most atomic.Int32
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() {
			slots.Do(context.Background(), func() error {
				n := running.Add(1)
				for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
				}
				<-release
				running.Add(-1)
				return nil
			})
		})
	}
	testkit.Eventually(t, 5*time.Second, "two calls running", func() bool { return running.Load() == 2 })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := slots.Do(ctx, func() error { t.Error("a call ran without a slot"); return nil }); !errors.Is(err, context.Canceled) {
		t.Errorf("a call waiting for a slot when its context ended: %v", err)
	}
	close(release)
	wg.Wait()
	if m := most.Load(); m != 2 {
		t.Errorf("%d calls ran at once, want 2", m)
	}
}
