package registration

import (
	"os"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// 1. Thirty drivers of all three types in one file all reach Registered, in kubelet and in
// multireg.
func TestThirtyDriversRegister(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 30)
	e.StartEndpoints(ds)
	p := mrproc.Start(t, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "30 drivers registered in kubelet", func() bool { return e.AllRegistered(ds) })
	wait.For(t, registerTimeout, "30 drivers Registered in multireg", func() bool { return registeredIn(p, ds) })
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want exactly one registration", d.Name, c)
		}
	}
}

// 2. A CSI driver whose registration fails three times is registered in the end on both
// kubelet versions. On 1.35 that takes multireg's recreate: a registrar that keeps its socket
// after a failure stays unregistered there.
func TestFailedRegistrationIsRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "flaky.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(d)
	e.K.FailRegistrations(d.Name, 3)

	// The incumbent's behaviour minus the exit: serve, report nothing, never recreate.
	still := driver{Name: "still.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(still)
	e.K.FailRegistrations(still.Name, 1)
	e.ServeRegistrar(e.SocketPath(still), still.Name, e.EndpointPath(still))

	p := mrproc.Start(t, e.WriteConfig([]driver{d}))
	wait.For(t, registerTimeout, "the flaky driver registered", func() bool { return e.K.Registered(d.Name) })
	if c := e.K.Counts(d.Name); c.RegistrationFailures != 3 {
		t.Errorf("registration failures %d, want 3", c.RegistrationFailures)
	}
	wait.For(t, registerTimeout, "Registered in multireg", func() bool { return p.Phase(d.Name) == "Registered" })
	if n := p.Count("registration failed", d.Name); n != 3 {
		t.Errorf("multireg logged %d failures, want 3 (one per rejection)", n)
	}

	if kubelet.RetriesRegisterFailures() {
		wait.For(t, registerTimeout, "kubelet "+kubelet.Version()+" to retry the non-recreating registrar", func() bool { return e.K.Registered(still.Name) })
	} else {
		// Kubelet's own backoff would have retried several times within 10 s.
		wait.Never(t, 10*time.Second, "kubelet "+kubelet.Version()+" registered a plugin whose registration failed, without a new socket", func() bool { return e.K.Registered(still.Name) })
		if c := e.K.Counts(still.Name); c.RegistrationFailures != 1 {
			t.Errorf("kubelet %s tried the non-recreating registrar %d times, want once", kubelet.Version(), c.RegistrationFailures)
		}
	}
}

// 3. One driver whose endpoint never comes up does not delay the other 29.
func TestDeadEndpointDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 30)
	dead := ds[0] // a CSI driver: its probe also calls GetPluginInfo
	e.StartEndpoints(ds[1:])
	p := mrproc.Start(t, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "29 drivers registered", func() bool { return e.AllRegistered(ds[1:]) })
	if e.K.Registered(dead.Name) || testenv.IsSocket(e.SocketPath(dead)) {
		t.Errorf("the driver without an endpoint was published")
	}
	if got := p.Phase(dead.Name); got != "" && got != "WaitingForEndpoint" {
		t.Errorf("the dead driver's phase %q, want WaitingForEndpoint", got)
	}
	// It registers as soon as its endpoint comes.
	e.StartEndpoint(dead)
	wait.For(t, registerTimeout, "the late driver registered", func() bool { return e.K.Registered(dead.Name) })
}

// 4. A registration socket deleted by hand is recreated and registered again.
func TestDeletedSocketReregisters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 3)
	e.StartEndpoints(ds)
	mrproc.Start(t, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "registered", func() bool { return e.AllRegistered(ds) })
	victim := ds[1]
	if err := os.Remove(e.SocketPath(victim)); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "a deregistration and a second registration", func() bool {
		c := e.K.Counts(victim.Name)
		return c.Deregistrations >= 1 && c.Registrations == 2 && e.K.Registered(victim.Name)
	})
	for _, d := range []driver{ds[0], ds[2]} {
		if c := e.K.Counts(d.Name); c.Registrations != 1 || c.Deregistrations != 0 {
			t.Errorf("%s moved: %+v", d.Name, c)
		}
	}
}

// 5. The driver restarts (its endpoint socket is recreated): kubelet registers a device
// plugin again; a DRA driver, and a CSI driver that answers NodeGetInfo as before, keep their
// registration.
func TestDriverRestartReregisters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 3)
	e.StartEndpoints(ds)
	p := mrproc.Start(t, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "registered", func() bool { return e.AllRegistered(ds) })
	for _, d := range ds {
		e.AwaitNodeInfoRecorded(p, d)
		e.StopEndpoint(d)
		e.StartEndpoint(d)
		kept := map[string]string{
			"CSIPlugin": "driver endpoint restarted; NodeGetInfo unchanged, the registration stays",
			"DRAPlugin": "driver endpoint restarted; kubelet reconnects to it by itself, the registration stays",
		}[d.Type]
		if kept != "" {
			wait.For(t, registerTimeout, d.Name+"'s restart seen", func() bool { return p.Count(kept, d.Name) == 1 })
			if c := e.K.Counts(d.Name); c.Registrations != 1 || c.Deregistrations != 0 || !e.K.Registered(d.Name) {
				t.Errorf("kubelet's calls for %s after its restart: %+v, want its one registration, kept", d.Name, c)
			}
			continue
		}
		wait.For(t, registerTimeout, d.Name+" registered again after its restart", func() bool {
			return e.K.Counts(d.Name).Registrations == 2 && e.K.Registered(d.Name)
		})
	}
	if n := p.Count("driver endpoint restarted; registering again", ""); n != 1 {
		t.Errorf("multireg logged %d restarts that register again, want 1 (the device plugin)", n)
	}
}

// 6. SIGKILL leaves stale sockets and a second run registers every driver again; SIGTERM
// leaves sockets and kubelet keeps the registrations; --cleanup-on-exit deregisters all.
func TestRestartAndShutdown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 6)
	e.StartEndpoints(ds)
	cfg := e.WriteConfig(ds)

	p := mrproc.Start(t, cfg)
	wait.For(t, registerTimeout, "registered", func() bool { return e.AllRegistered(ds) })
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, exitTimeout)
	for _, d := range ds {
		if !testenv.IsSocket(e.SocketPath(d)) {
			t.Fatalf("%s: no socket left after SIGKILL", d.Name)
		}
	}

	p = mrproc.Start(t, cfg)
	wait.For(t, registerTimeout, "every driver registered again by the second run", func() bool {
		for _, d := range ds {
			if e.K.Counts(d.Name).Registrations != 2 || !e.K.Registered(d.Name) {
				return false
			}
		}
		return true
	})

	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	before := e.Registrations(ds)
	wait.Never(t, 3*time.Second, "kubelet deregistered a plugin after SIGTERM", func() bool {
		for _, d := range ds {
			if !e.K.Registered(d.Name) || !testenv.IsSocket(e.Socket(d)) {
				return true
			}
		}
		return false
	})

	p = mrproc.Start(t, cfg, "--cleanup-on-exit")
	wait.For(t, registerTimeout, "registered by the third run", func() bool { return e.registeredAgain(ds, before) })
	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	wait.For(t, registerTimeout, "every plugin deregistered after --cleanup-on-exit", func() bool {
		return len(e.K.RegisteredNames()) == 0
	})
	for _, d := range ds {
		for _, path := range []string{e.SocketPath(d), e.AltSocketPath(d)} {
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Errorf("%s: socket %s after --cleanup-on-exit: %v", d.Name, path, err)
			}
		}
	}
}

// 6b. SIGKILL, and the next run publishes a DRA driver's socket while kubelet's reconciler is
// between its two loops (held there until the socket's path changes): the new socket is at
// the driver's second path, so kubelet's registration of it, before it has unregistered the
// old one, never overwrites the old one's entry (which would leave the old registration in its
// DRA manager for good and the driver refused). The DRA manager refuses it at most once (it
// still holds the endpoint), and the driver is registered once more.
func TestRestartBetweenReconcileLoops(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := []driver{{Name: "held.example.com", Type: "DRAPlugin"}}
	counts := e.killedAfterRegistration(t, ds)
	before := len(e.K.EventsFor(ds[0].Name))

	h := e.holdPass(t, ds[0])
	p := mrproc.Start(t, e.Cfg)
	e.heldUntilChanged(t, h)
	wait.For(t, registerTimeout, "registered once more by the next run", func() bool {
		return e.registeredAgain(ds, counts) && registeredEverywhere(t, e, p, ds)
	})
	c := e.K.Counts(ds[0].Name)
	t.Logf("kubelet %s: %+v; no registration for %s", kubelet.Version(), c, longestAbsence(e.K.EventsFor(ds[0].Name)[before:]))
	if c.RegistrationFailures > 1 || c.ValidationFailures != 0 {
		t.Errorf("kubelet's calls: %+v, want one refusal at most", c)
	}
}

// 7. A regular file at a driver's socket path is left untouched; the other drivers are not
// affected.
func TestFileInTheWayIsUntouched(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("", 6)
	e.StartEndpoints(ds)
	blocked := ds[2]
	if err := os.MkdirAll(e.Reg, 0o750); err != nil {
		t.Fatal(err)
	}
	const content = "not yours"
	if err := os.WriteFile(e.SocketPath(blocked), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	p := mrproc.Start(t, e.WriteConfig(ds))
	others := append(append([]driver{}, ds[:2]...), ds[3:]...)
	wait.For(t, registerTimeout, "the other drivers registered", func() bool { return e.AllRegistered(others) })
	wait.For(t, registerTimeout, "multireg to report the file", func() bool {
		return p.Phase(blocked.Name) == "BackingOff" && p.Count("registration failed", blocked.Name) >= 2
	})
	if b, err := os.ReadFile(e.SocketPath(blocked)); err != nil || string(b) != content {
		t.Errorf("the file in the way: %q, %v; want it untouched", b, err)
	}
	if e.K.Registered(blocked.Name) {
		t.Error("the blocked driver is registered")
	}
}

// 6c. A DRA driver with a fixed endpoint registered again by a restart of multireg without a
// hand-over (SIGKILL, then the next run) goes to its second registration path, which kubelet
// does not hold: kubelet deregisters the old socket and registers the new one in one
// reconcile pass. The time kubelet held no registration of it is logged: at most a pass
// (it was about 3 s here, the old socket's path waited for).
func TestDRARegisteredAgainWithinAPass(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := []driver{{Name: "again.example.com", Type: "DRAPlugin"}}
	counts := e.killedAfterRegistration(t, ds)
	before := len(e.K.EventsFor(ds[0].Name))
	e.registeredByNextRun(t, ds, counts)
	events := e.K.EventsFor(ds[0].Name)[before:]
	gap := longestAbsence(events)
	t.Logf("kubelet %s held no registration of %s for %s", kubelet.Version(), ds[0].Name, gap)
	if gap > 1500*time.Millisecond {
		t.Errorf("kubelet held no registration for %s, want at most one reconcile pass (1 s, and a little)", gap)
	}
	if c := e.K.Counts(ds[0].Name); c.RegistrationFailures != 0 || c.ValidationFailures != 0 {
		t.Errorf("kubelet's calls: %+v, want no refusal", c)
	}
}
