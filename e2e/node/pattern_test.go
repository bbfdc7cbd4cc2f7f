package node_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/node/endpoints"
)

// 4e. A DRA driver's rolling update, the kubeletplugin helper's rolling-update mode: each
// instance listens on dra-<pod uid>.sock, and the drivers file names them by the pattern
// dra-*.sock. The new instance is registered beside the old one, then the old one goes: kubelet's
// plugin manager (its own metrics, polled every 200 ms) holds one of the driver's registration
// sockets at every look, a claim is prepared by the new instance, and once the old instance is
// gone its registration is withdrawn. (The switch of the drivers file to the pattern comes first:
// like any change of a driver's endpoint, it registers the driver anew.)
func scenarioDRARollingUpdate(t *testing.T, mr *hostMultireg, eps *hostDrivers, config string) {
	dir := filepath.Dir(eps.dra.Path())
	start := func(uid string) *endpoints.DRA {
		t.Helper()
		d, err := endpoints.StartDRA(filepath.Join(dir, "dra-"+uid+".sock"), endpoints.DRAOptions{DriverName: draName})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(d.Stop)
		return d
	}
	registeredAt := func(endpoint string) {
		t.Helper()
		waitUntil(t, time.Minute, draName+" registered at "+filepath.Base(endpoint), func(ctx context.Context) (bool, string) {
			st, err := mr.status(ctx)
			if err != nil {
				return false, err.Error()
			}
			s := st[draName]
			return s.Phase == "Registered" && s.Endpoint == endpoint, fmt.Sprintf("%+v", s)
		})
	}
	regDir := filepath.Dir(socketOf(t, draName))
	ours := []string{filepath.Join(regDir, draName+"-reg.sock"), filepath.Join(regDir, draName+"-reg.1.sock")}

	a := start("uid1")
	writeFileAtomic(t, config, hostConfig(entriesAfterRollingUpdate()...))
	registeredAt(a.Path())
	eps.dra.Stop() // the instance the fixed endpoint named
	waitUntil(t, time.Minute, "kubelet holds the pattern's registration", func(ctx context.Context) (bool, string) {
		reg, err := kubeletRegistered(ctx)
		return err == nil && len(held(reg, ours...)) == 1, fmt.Sprint(reg, err)
	})
	// Polled from here on: kubelet holds one of the driver's two registration sockets.
	watch := holdWatch(t, ours...)

	b := start("uid2") // the rolling update's new pod
	registeredAt(b.Path())
	waitUntil(t, time.Minute, "kubelet holds both instances' registrations", func(ctx context.Context) (bool, string) {
		reg, err := kubeletRegistered(ctx)
		return err == nil && reg[ours[0]] && reg[ours[1]], fmt.Sprint(reg, err)
	})
	before := a.Calls("NodePrepareResources")
	draClaimPod(t, b)
	if n := a.Calls("NodePrepareResources"); n != before {
		t.Errorf("kubelet prepared the claim on the old instance (%d calls), want the newest", n-before)
	}
	a.Stop() // the old pod ends
	waitUntil(t, time.Minute, "the old instance's registration withdrawn", func(ctx context.Context) (bool, string) {
		reg, err := kubeletRegistered(ctx)
		if err != nil {
			return false, err.Error()
		}
		st, err := mr.status(ctx)
		if err != nil {
			return false, err.Error()
		}
		h := held(reg, ours...)
		return len(h) == 1 && h[0] == st[draName].Socket, fmt.Sprint(h, st[draName])
	})
	eps.dra = b
	looks, missing := watch.stop()
	if missing > 0 {
		t.Errorf("kubelet's plugin manager held none of %s's registration sockets at %d of %d looks", draName, missing, looks)
	}
	t.Logf("DRA rolling update: kubelet held a registration of %s at all %d looks (every 200 ms)", draName, looks)
	figures = append(figures, fmt.Sprintf("DRA rolling update (two instances, dra-*.sock): kubelet held a registration at %d of %d looks, longest gap %dms; the claim was prepared by the new instance", looks-missing, looks, watch.gap.longest.Milliseconds()))
}

// entriesAfterRollingUpdate are the drivers file's entries from scenario 4e on: the DRA driver
// named by a pattern.
func entriesAfterRollingUpdate() []string {
	return []string{entryA(), entryB(), entryDP(), driverEntry(draName, "DRAPlugin", endpointPath("dra", "dra-*.sock")), entryCSlow()}
}

// held returns which of the sockets kubelet's plugin manager holds.
func held(reg map[string]bool, sockets ...string) []string {
	var out []string
	for _, s := range sockets {
		if reg[s] {
			out = append(out, s)
		}
	}
	return out
}

// holdWatcher polls kubelet's plugin manager until stopped, counting the looks at which it held
// none of some registration sockets.
type holdWatcher struct {
	cancel         context.CancelFunc
	done           chan struct{}
	looks, missing int
	gap            shortfall // how long it was seen holding none (from look to look)
}

func holdWatch(t *testing.T, sockets ...string) *holdWatcher {
	ctx, cancel := context.WithCancel(context.Background())
	w := &holdWatcher{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			reg, err := kubeletRegistered(ctx)
			if err != nil {
				continue // the look failed: it says nothing
			}
			w.looks++
			n := len(held(reg, sockets...))
			if n == 0 {
				w.missing++
			}
			w.gap.observe(min(n, 1), 1)
		}
	}()
	t.Cleanup(func() { w.stop() })
	return w
}

// stop ends the watch and returns its counts.
func (w *holdWatcher) stop() (looks, missing int) {
	w.cancel()
	<-w.done
	w.gap.observe(1, 1) // a gap still open at the end ends here
	return w.looks, w.missing
}
