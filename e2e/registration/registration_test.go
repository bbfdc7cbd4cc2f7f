// Package registration runs the built multireg binary against the real kubelet plugin
// manager, on kubelet 1.36 (go.mod) and 1.35 (kube135/go.mod).
package registration

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/plugins"
)

// 1. Thirty drivers of all three types in one file all reach Registered, in kubelet and in
// multireg.
func TestThirtyDriversRegister(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(30)
	e.startEndpoints(ds)
	p := mrproc.Start(t, e.writeConfig(ds))
	kubelet.WaitFor(t, registerTimeout, "30 drivers registered in kubelet", func() bool { return e.allRegistered(ds) })
	kubelet.WaitFor(t, registerTimeout, "30 drivers Registered in multireg", func() bool { return registeredIn(p, ds) })
	for _, d := range ds {
		if c := e.k.Counts(d.name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want exactly one registration", d.name, c)
		}
	}
}

// 2. A CSI driver whose registration fails three times is registered in the end on both
// kubelet versions. On 1.35 that takes multireg's recreate: a registrar that keeps its socket
// after a failure stays unregistered there.
func TestFailedRegistrationIsRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	d := driver{name: "flaky.csi.example.com", typ: "CSIPlugin"}
	e.startEndpoint(d)
	e.k.FailRegistrations(d.name, 3)

	// The incumbent's behaviour minus the exit: serve, report nothing, never recreate.
	still := driver{name: "still.csi.example.com", typ: "CSIPlugin"}
	e.startEndpoint(still)
	e.k.FailRegistrations(still.name, 1)
	serveWithoutRecreate(t, e.socketPath(still), still.name, e.endpointPath(still))

	p := mrproc.Start(t, e.writeConfig([]driver{d}))
	kubelet.WaitFor(t, registerTimeout, "the flaky driver registered", func() bool { return e.k.Registered(d.name) })
	if c := e.k.Counts(d.name); c.RegistrationFailures != 3 {
		t.Errorf("registration failures %d, want 3", c.RegistrationFailures)
	}
	kubelet.WaitFor(t, registerTimeout, "Registered in multireg", func() bool { return p.Phase(d.name) == "Registered" })
	if n := p.Count("registration failed", d.name); n != 3 {
		t.Errorf("multireg logged %d failures, want 3 (one per rejection)", n)
	}

	if kubelet.RetriesRegisterFailures() {
		kubelet.WaitFor(t, registerTimeout, "kubelet "+kubelet.Version()+" to retry the non-recreating registrar", func() bool { return e.k.Registered(still.name) })
	} else {
		// Kubelet's own backoff would have retried several times within 10 s.
		kubelet.Never(t, 10*time.Second, "kubelet "+kubelet.Version()+" registered a plugin whose registration failed, without a new socket", func() bool { return e.k.Registered(still.name) })
		if c := e.k.Counts(still.name); c.RegistrationFailures != 1 {
			t.Errorf("kubelet %s tried the non-recreating registrar %d times, want once", kubelet.Version(), c.RegistrationFailures)
		}
	}
}

// serveWithoutRecreate serves the Registration API on path until the test ends, ignoring
// every verdict: a registrar that does not recreate its socket.
func serveWithoutRecreate(t *testing.T, path, name, endpoint string) {
	t.Helper()
	r, err := plugins.ServeRegistrar(path, &registerapi.PluginInfo{
		Type: "CSIPlugin", Name: name, Endpoint: endpoint, SupportedVersions: []string{"1.0.0"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
}

// 3. One driver whose endpoint never comes up does not delay the other 29.
func TestDeadEndpointDoesNotDelayOthers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(30)
	dead := ds[0] // a CSI driver: its probe also calls GetPluginInfo
	for _, d := range ds[1:] {
		e.startEndpoint(d)
	}
	p := mrproc.Start(t, e.writeConfig(ds))
	kubelet.WaitFor(t, registerTimeout, "29 drivers registered", func() bool { return e.allRegistered(ds[1:]) })
	if e.k.Registered(dead.name) || isSocket(e.socketPath(dead)) {
		t.Errorf("the driver without an endpoint was published")
	}
	if got := p.Phase(dead.name); got != "" && got != "WaitingForEndpoint" {
		t.Errorf("the dead driver's phase %q, want WaitingForEndpoint", got)
	}
	// It registers as soon as its endpoint comes.
	e.startEndpoint(dead)
	kubelet.WaitFor(t, registerTimeout, "the late driver registered", func() bool { return e.k.Registered(dead.name) })
}

// 4. A registration socket deleted by hand is recreated and registered again.
func TestDeletedSocketReregisters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(3)
	e.startEndpoints(ds)
	mrproc.Start(t, e.writeConfig(ds))
	kubelet.WaitFor(t, registerTimeout, "registered", func() bool { return e.allRegistered(ds) })
	victim := ds[1]
	if err := os.Remove(e.socketPath(victim)); err != nil {
		t.Fatal(err)
	}
	kubelet.WaitFor(t, registerTimeout, "a deregistration and a second registration", func() bool {
		c := e.k.Counts(victim.name)
		return c.Deregistrations >= 1 && c.Registrations == 2 && e.k.Registered(victim.name)
	})
	for _, d := range []driver{ds[0], ds[2]} {
		if c := e.k.Counts(d.name); c.Registrations != 1 || c.Deregistrations != 0 {
			t.Errorf("%s moved: %+v", d.name, c)
		}
	}
}

// 5. The driver restarts (its endpoint socket is recreated): kubelet registers it again.
func TestDriverRestartReregisters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(3)
	e.startEndpoints(ds)
	p := mrproc.Start(t, e.writeConfig(ds))
	kubelet.WaitFor(t, registerTimeout, "registered", func() bool { return e.allRegistered(ds) })
	for _, d := range ds {
		e.eps[d.name].Stop()
		e.startEndpoint(d)
		kubelet.WaitFor(t, registerTimeout, d.name+" registered again after its restart", func() bool {
			return e.k.Counts(d.name).Registrations == 2 && e.k.Registered(d.name)
		})
	}
	if n := p.Count("driver endpoint restarted; registering again", ""); n != 3 {
		t.Errorf("multireg logged %d restarts, want 3", n)
	}
}

// 6. SIGKILL leaves stale sockets and a second run registers every driver again; SIGTERM
// leaves sockets and kubelet keeps the registrations; --cleanup-on-exit deregisters all.
func TestRestartAndShutdown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(6)
	e.startEndpoints(ds)
	cfg := e.writeConfig(ds)

	p := mrproc.Start(t, cfg)
	kubelet.WaitFor(t, registerTimeout, "registered", func() bool { return e.allRegistered(ds) })
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, exitTimeout)
	for _, d := range ds {
		if !isSocket(e.socketPath(d)) {
			t.Fatalf("%s: no socket left after SIGKILL", d.name)
		}
	}

	p = mrproc.Start(t, cfg)
	kubelet.WaitFor(t, registerTimeout, "every driver registered again by the second run", func() bool {
		for _, d := range ds {
			if e.k.Counts(d.name).Registrations != 2 || !e.k.Registered(d.name) {
				return false
			}
		}
		return true
	})

	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	before := e.registrations(ds)
	kubelet.Never(t, 3*time.Second, "kubelet deregistered a plugin after SIGTERM", func() bool {
		for _, d := range ds {
			if !e.k.Registered(d.name) || !isSocket(e.socketPath(d)) {
				return true
			}
		}
		return false
	})

	p = mrproc.Start(t, cfg, "--cleanup-on-exit")
	kubelet.WaitFor(t, registerTimeout, "registered by the third run", func() bool { return e.registeredAgain(ds, before) })
	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	kubelet.WaitFor(t, registerTimeout, "every plugin deregistered after --cleanup-on-exit", func() bool {
		return len(e.k.RegisteredNames()) == 0
	})
	for _, d := range ds {
		if _, err := os.Lstat(e.socketPath(d)); !os.IsNotExist(err) {
			t.Errorf("%s: socket after --cleanup-on-exit: %v", d.name, err)
		}
	}
}

// 7. A regular file at a driver's socket path is left untouched; the other drivers are not
// affected.
func TestFileInTheWayIsUntouched(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(6)
	e.startEndpoints(ds)
	blocked := ds[2]
	if err := os.MkdirAll(e.reg, 0o750); err != nil {
		t.Fatal(err)
	}
	const content = "not yours"
	if err := os.WriteFile(e.socketPath(blocked), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	p := mrproc.Start(t, e.writeConfig(ds))
	others := append(append([]driver{}, ds[:2]...), ds[3:]...)
	kubelet.WaitFor(t, registerTimeout, "the other drivers registered", func() bool { return e.allRegistered(others) })
	kubelet.WaitFor(t, registerTimeout, "multireg to report the file", func() bool {
		return p.Phase(blocked.name) == "BackingOff" && p.Count("registration failed", blocked.name) >= 2
	})
	if b, err := os.ReadFile(e.socketPath(blocked)); err != nil || string(b) != content {
		t.Errorf("the file in the way: %q, %v; want it untouched", b, err)
	}
	if e.k.Registered(blocked.name) {
		t.Error("the blocked driver is registered")
	}
}

// 8. Two multireg on one directory: the second waits, and takes over when the first exits.
func TestSecondInstanceWaitsAndTakesOver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	ds := mixed(3)
	e.startEndpoints(ds)
	cfg := e.writeConfig(ds)
	first := mrproc.Start(t, cfg)
	kubelet.WaitFor(t, registerTimeout, "registered", func() bool { return e.allRegistered(ds) })

	second := mrproc.Start(t, cfg)
	kubelet.WaitFor(t, registerTimeout, "the second instance to say it waits", func() bool {
		return second.Count("another multireg holds the registration directory; waiting for it to exit", "") == 1
	})
	before := e.registrations(ds)
	kubelet.Never(t, 2*time.Second, "the waiting instance touched a socket", func() bool {
		return fmt.Sprint(e.registrations(ds)) != fmt.Sprint(before)
	})

	first.Signal(t, syscall.SIGTERM)
	if code := first.Wait(t, exitTimeout); code != 0 {
		t.Fatalf("first instance exit code %d", code)
	}
	kubelet.WaitFor(t, registerTimeout, "the second instance to take over and register every driver", func() bool {
		for _, d := range ds {
			if e.k.Counts(d.name).Registrations != before[d.name]+1 || !e.k.Registered(d.name) {
				return false
			}
		}
		return second.Count("took over the registration directory", "") == 1
	})
	if second.Exited() {
		t.Error("the second instance exited")
	}
}
