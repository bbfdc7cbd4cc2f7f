package registration

import (
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// startInstance serves one instance of d at name in d's endpoint directory, until the test
// ends or it is stopped.
func (e *env) startInstance(d driver, name string) *plugins.Endpoint {
	e.T.Helper()
	ep, err := plugins.Start(filepath.Join(filepath.Dir(d.Endpoint), name), d.Type, d.Name)
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(ep.Stop)
	return ep
}

// startPattern sets d's endpoint to the pattern in subdir of the endpoints' directory, and
// starts multireg with d and d's first instance, first; it returns once kubelet holds that
// instance's registration.
func (e *env) startPattern(d *driver, subdir, pattern, first string) (dir string, ep *plugins.Endpoint, p *mrproc.Process) {
	e.T.Helper()
	d.Endpoint = filepath.Join(e.Dir, "ep", subdir, pattern)
	dir = filepath.Dir(d.Endpoint)
	ep = e.startInstance(*d, first)
	p = mrproc.Start(e.T, e.WriteConfig([]driver{*d}))
	e.registeredAt(*d, filepath.Join(dir, first))
	return dir, ep, p
}

// registeredAt waits until kubelet holds exactly the endpoints want for d.
func (e *env) registeredAt(d driver, want ...string) {
	e.T.Helper()
	wait.For(e.T, registerTimeout, d.Name+" registered at "+filepath.Base(want[len(want)-1]), func() bool {
		got := e.K.RegisteredEndpoints(d.Name)
		slices.Sort(got)
		return slices.Equal(got, want)
	})
}

// longestAbsence replays kubelet's Register and DeRegister calls for name, from its first
// registration on, and returns the longest time kubelet held no registration of it: one
// instance per endpoint, as kubelet's DRA manager keeps them (a CSI driver or a device plugin
// has one at a time). An absence still running at the end counts until now.
func longestAbsence(events []kubelet.Event) time.Duration {
	held := map[string]bool{}
	var longest time.Duration
	var since time.Time // when the last absence began; zero while held or before the first
	for _, ev := range events {
		switch ev.Kind {
		case kubelet.EventRegister:
			held[ev.Endpoint] = true
		case kubelet.EventDeRegister:
			delete(held, ev.Endpoint)
		default:
			continue
		}
		switch {
		case len(held) == 0 && since.IsZero():
			since = ev.Time
		case len(held) > 0 && !since.IsZero():
			longest = max(longest, ev.Time.Sub(since))
			since = time.Time{}
		}
	}
	if !since.IsZero() {
		longest = max(longest, time.Since(since))
	}
	return longest
}

// Endpoints whose names change (an endpoint pattern): a DRA driver's rolling update is
// handed over with kubelet holding a registration throughout; a device plugin's restart under
// a new name is followed; a second CSI instance moves nothing while the first answers, and
// takes over when it goes.
func TestEndpointPattern(t *testing.T) {
	t.Run("DRAPlugin", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		d := driver{Name: "gpu.example.com", Type: "DRAPlugin"}
		dir, old, p := e.startPattern(&d, "gpu", "dra-*.sock", "dra-uid1.sock")

		e.startInstance(d, "dra-uid2.sock") // the rolling update's new pod
		e.registeredAt(d, filepath.Join(dir, "dra-uid1.sock"), filepath.Join(dir, "dra-uid2.sock"))
		wait.Never(t, 2*time.Second, "the old instance's registration withdrawn while it runs", func() bool {
			return len(e.K.RegisteredEndpoints(d.Name)) != 2
		})
		old.Stop() // the old pod ends
		e.registeredAt(d, filepath.Join(dir, "dra-uid2.sock"))

		if gap := longestAbsence(e.K.EventsFor(d.Name)); gap != 0 {
			t.Errorf("kubelet held no registration of %s for %s during the handover, want never", d.Name, gap)
		}
		if c := e.K.Counts(d.Name); c.Registrations != 2 || c.Deregistrations != 1 {
			t.Errorf("kubelet's calls: %+v, want 2 registrations and 1 deregistration", c)
		}
		if n := p.Count("driver endpoint restarted; registering again", d.Name); n != 0 {
			t.Errorf("%d re-registrations logged, want none", n)
		}

		// multireg restarts: the earlier run's socket, which kubelet holds for dra-uid2 (and a
		// second registration of one endpoint is refused), is removed, and the driver registered
		// through its other socket.
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, exitTimeout); code != 0 {
			t.Fatalf("exit code %d after SIGTERM, want 0", code)
		}
		regs := e.K.Counts(d.Name).Registrations
		p = mrproc.Start(t, e.Cfg)
		wait.For(t, registerTimeout, "Registered by the next run", func() bool { return p.Phase(d.Name) == "Registered" })
		e.registeredAt(d, filepath.Join(dir, "dra-uid2.sock"))
		if c := e.K.Counts(d.Name); c.Registrations != regs+1 || c.RegistrationFailures != 0 {
			t.Errorf("kubelet's calls after multireg's restart: %+v, want one more registration and no failure", c)
		}
	})

	t.Run("DevicePlugin", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		d := driver{Name: "example.com/widget", Type: "DevicePlugin"}
		dir, old, _ := e.startPattern(&d, "dp", "dp.*", "dp.1700000001")

		old.Stop() // the plugin restarts under a new name
		e.startInstance(d, "dp.1700000002")
		e.registeredAt(d, filepath.Join(dir, "dp.1700000002"))
		if c := e.K.Counts(d.Name); c.Registrations != 2 {
			t.Errorf("kubelet's calls: %+v, want 2 registrations", c)
		}
		t.Logf("kubelet held no registration of %s for %s after the restart", d.Name, longestAbsence(e.K.EventsFor(d.Name)))
	})

	t.Run("CSIPlugin", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		d := driver{Name: "csi.example.com", Type: "CSIPlugin"}
		dir, a, p := e.startPattern(&d, "csi", "csi-*.sock", "csi-a.sock")

		e.startInstance(d, "csi-b.sock")
		wait.Never(t, 2*time.Second, "kubelet's registration moved while the first instance answers", func() bool {
			c := e.K.Counts(d.Name)
			return c.Registrations != 1 || c.Deregistrations != 0
		})
		a.Stop()
		e.registeredAt(d, filepath.Join(dir, "csi-b.sock"))
		if c := e.K.Counts(d.Name); c.Registrations != 2 || c.Deregistrations != 1 {
			t.Errorf("kubelet's calls: %+v, want 2 registrations and 1 deregistration", c)
		}
		if n := p.Count("driver endpoint moved", d.Name); n != 1 {
			t.Errorf("%d moves logged, want 1", n)
		}
		t.Logf("kubelet held no registration of %s for %s after the move", d.Name, longestAbsence(e.K.EventsFor(d.Name)))
	})
}
