package faults

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: multireg is killed (SIGKILL) right after the drivers file was changed — before,
// while or just after it applies the change. Each round adds a driver and moves another to a
// new endpoint; the restarted multireg has the new file in force, with every driver
// registered in kubelet at its configured endpoint.
func TestSIGKILLMidReload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cur := testenv.Mixed("m", 6)
	p := e.startAll(cur)
	for round, delay := range []time.Duration{0, 30 * time.Millisecond, 100 * time.Millisecond, 300 * time.Millisecond} {
		added := testenv.Mixed(fmt.Sprintf("m%d", round), 1)[0]
		e.StartEndpoint(added)
		next := slices.Clone(cur)
		i := round % len(next)
		next[i].Endpoint = filepath.Join(e.Dir, fmt.Sprintf("ep%d", round), "csi.sock")
		e.StartEndpoint(next[i])
		next = append(next, added)

		e.WriteConfig(next)
		time.Sleep(delay) // the moment of the kill: before, while or after the reload is applied
		p.Signal(t, syscall.SIGKILL)
		p.Wait(t, exitTimeout)
		t.Logf("round %d: killed %v after the write; %d config reloads logged", round, delay, p.Count("config reloaded", ""))

		p = mrproc.Start(t, e.Cfg)
		e.waitRegistered(p, next)
		wait.For(t, registerTimeout, "every driver registered at its configured endpoint", func() bool {
			for _, d := range next {
				if eps := e.K.RegisteredEndpoints(d.Name); len(eps) != 1 || eps[0] != e.EndpointPath(d) {
					return false
				}
			}
			return true
		})
		st := p.Status(t)
		if !st.Config.LastReloadSuccessful || st.Config.Generation != 1 || len(st.Drivers) != len(next) {
			t.Fatalf("round %d: config %+v with %d drivers, want generation 1 with %d", round, st.Config, len(st.Drivers), len(next))
		}
		cur = next
	}
}

// Fault: multireg is killed (SIGKILL) right after a driver was removed from the drivers file,
// before it could apply the change. The restarted multireg has the new file in force, so the
// removed driver must not stay registered in kubelet through the socket the killed process
// left.
func TestSIGKILLMidReloadRemovedDriver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("q", 6)
	removed := ds[4]
	kept := testenv.Without(ds, removed.Name)
	p := e.startAll(ds)

	e.WriteConfig(kept)
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, exitTimeout)
	p = mrproc.Start(t, e.Cfg)
	e.waitRegistered(p, kept)
	wait.For(t, registerTimeout, "the removed driver deregistered and its socket gone", func() bool {
		return !e.K.Registered(removed.Name) && !testenv.Exists(e.SocketPath(removed))
	})
}

// Fault: SIGTERM while drivers back off — one rejected by kubelet, one whose endpoint is not
// there, one whose socket path holds a file — each with a 30 s backoff. multireg exits 0
// within 5 s; the registered drivers keep their sockets and their registrations; the file
// stays.
func TestSIGTERMDuringBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("b", 6)
	slow := "    backoff: {initialInterval: 30s, maxInterval: 30s, randomizationFactor: 0}\n"
	rejected := driver{Name: "rejected.csi.example.com", Type: "CSIPlugin", Extra: slow}
	absent := driver{Name: "absent.dra.example.com", Type: "DRAPlugin", Extra: slow}
	blocked := driver{Name: "example.com/blocked", Type: "DevicePlugin", Extra: slow}
	e.StartEndpoints(append(ds, rejected, blocked))
	if err := os.MkdirAll(e.Reg, 0o750); err != nil {
		t.Fatal(err)
	}
	const content = "in the way"
	if err := os.WriteFile(e.SocketPath(blocked), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	e.K.FailRegistrations(rejected.Name, 1)
	p := mrproc.Start(t, e.WriteConfig(append(ds, rejected, absent, blocked)))
	e.waitRegistered(p, ds)
	waitPhases(t, p, []driver{rejected, blocked}, "BackingOff")
	waitPhases(t, p, []driver{absent}, "WaitingForEndpoint")
	for _, name := range []string{rejected.Name, absent.Name, blocked.Name} {
		d, _ := p.Status(t).Driver(name)
		if d.LastError == "" {
			t.Errorf("%s: no lastError in %s", name, d.Phase)
		}
	}
	before := e.snap(ds)

	start := time.Now()
	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
	t.Logf("exited %v after SIGTERM", time.Since(start).Round(time.Millisecond))
	if p.Count("multireg stopped", "") != 1 {
		t.Error("multireg did not log that it stopped")
	}
	e.holdUnmoved(before, ds)
	if err := testenv.FileHolds(e.SocketPath(blocked), content); err != nil {
		t.Error(err)
	}
}
