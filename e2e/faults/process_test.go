package faults

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
)

// Fault: multireg is killed (SIGKILL) right after the drivers file was changed — before,
// while or just after it applies the change. Each round adds a driver and moves another to a
// new endpoint; the restarted multireg has the new file in force, with every driver
// registered in kubelet at its configured endpoint.
func TestSIGKILLMidReload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cur := mixed("m", 6)
	p := e.startAll(cur)
	for round, delay := range []time.Duration{0, 30 * time.Millisecond, 100 * time.Millisecond, 300 * time.Millisecond} {
		added := mixed(fmt.Sprintf("m%d", round), 1)[0]
		e.startEndpoint(added)
		next := slices.Clone(cur)
		i := round % len(next)
		next[i].ep = filepath.Join(e.dir, fmt.Sprintf("ep%d", round), "csi.sock")
		e.startEndpoint(next[i])
		next = append(next, added)

		e.writeConfig(next)
		time.Sleep(delay) // the moment of the kill: before, while or after the reload is applied
		p.Signal(t, syscall.SIGKILL)
		p.Wait(t, exitTimeout)
		t.Logf("round %d: killed %v after the write; %d config reloads logged", round, delay, p.Count("config reloaded", ""))

		p = mrproc.Start(t, e.cfg)
		e.waitRegistered(p, next)
		kubelet.WaitFor(t, registerTimeout, "every driver registered at its configured endpoint", func() bool {
			for _, d := range next {
				if eps := e.k.RegisteredEndpoints(d.name); len(eps) != 1 || eps[0] != e.endpointPath(d) {
					return false
				}
			}
			return true
		})
		st := status(t, p)
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
	ds := mixed("q", 6)
	removed := ds[4]
	kept := without(ds, removed.name)
	p := e.startAll(ds)

	e.writeConfig(kept)
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, exitTimeout)
	p = mrproc.Start(t, e.cfg)
	e.waitRegistered(p, kept)
	kubelet.WaitFor(t, registerTimeout, "the removed driver deregistered and its socket gone", func() bool {
		return !e.k.Registered(removed.name) && !isExisting(e.socketPath(removed))
	})
}

// Fault: SIGTERM while drivers back off — one rejected by kubelet, one whose endpoint is not
// there, one whose socket path holds a file — each with a 30 s backoff. multireg exits 0
// within 5 s; the registered drivers keep their sockets and their registrations; the file
// stays.
func TestSIGTERMDuringBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := mixed("b", 6)
	slow := "    backoff: {initialInterval: 30s, maxInterval: 30s, randomizationFactor: 0}\n"
	rejected := driver{name: "rejected.csi.example.com", typ: "CSIPlugin", extra: slow}
	absent := driver{name: "absent.dra.example.com", typ: "DRAPlugin", extra: slow}
	blocked := driver{name: "example.com/blocked", typ: "DevicePlugin", extra: slow}
	for _, d := range append(ds, rejected, blocked) {
		e.startEndpoint(d)
	}
	if err := os.MkdirAll(e.reg, 0o750); err != nil {
		t.Fatal(err)
	}
	const content = "in the way"
	if err := os.WriteFile(e.socketPath(blocked), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	e.k.FailRegistrations(rejected.name, 1)
	p := mrproc.Start(t, e.writeConfig(append(ds, rejected, absent, blocked)))
	e.waitRegistered(p, ds)
	waitPhases(t, p, []driver{rejected, blocked}, "BackingOff")
	waitPhases(t, p, []driver{absent}, "WaitingForEndpoint")
	for _, name := range []string{rejected.name, absent.name, blocked.name} {
		d, _ := status(t, p).driver(name)
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
	if err := fileHolds(e.socketPath(blocked), content); err != nil {
		t.Error(err)
	}
}

// Fault: two multireg start at once on one registration directory. One serves, the other
// waits without touching anything (no HTTP, no socket); when the first exits — by SIGTERM, or
// killed — the second takes over and every driver is registered on its sockets.
func TestTwoInstances(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := mixed("i", 6)
			for _, d := range ds {
				e.startEndpoint(d)
			}
			cfg := e.writeConfig(ds)
			a, b := mrproc.Start(t, cfg), mrproc.Start(t, cfg)
			const waits = "another multireg holds the registration directory; waiting for it to exit"
			var first, second *mrproc.Process
			kubelet.WaitFor(t, registerTimeout, "one instance to serve and the other to wait", func() bool {
				switch {
				case a.HTTPAddr() != "" && b.Count(waits, "") == 1:
					first, second = a, b
				case b.HTTPAddr() != "" && a.Count(waits, "") == 1:
					first, second = b, a
				}
				return first != nil
			})
			e.waitRegistered(first, ds)
			before := e.snap(ds)
			kubelet.Never(t, quietPeriod, "the waiting instance did something", func() bool {
				return second.HTTPAddr() != "" || second.Count("registration socket published", "") != 0 || second.Exited() || e.moved(before, ds) != ""
			})
			for _, d := range ds {
				if c := e.k.Counts(d.name); c.Registrations != 1 {
					t.Errorf("%s: %+v, want one registration", d.name, c)
				}
			}

			first.Signal(t, sig)
			code := first.Wait(t, exitTimeout)
			if sig == syscall.SIGTERM && code != 0 {
				t.Errorf("first instance: exit code %d after SIGTERM", code)
			}
			kubelet.WaitFor(t, registerTimeout, "the second instance to take over and register every driver again", func() bool {
				for _, d := range ds {
					if e.k.Counts(d.name).Registrations != 2 || !e.k.Registered(d.name) {
						return false
					}
				}
				return second.Count("took over the registration directory", "") == 1
			})
			waitPhases(t, second, ds, "Registered")
			for _, d := range ds {
				if idOf(e.socketPath(d)) == before.ids[d.name] {
					t.Errorf("%s: still the first instance's socket", d.name)
				}
			}
			if second.Exited() {
				t.Error("the second instance exited")
			}
		})
	}
}

// waitsLog is what an instance logs while another holds the registration directory.
const waitsLog = "another multireg holds the registration directory; waiting for it to exit"

// startPair runs a registered multireg on ds and a second one on the same file, and returns
// both once the second says it waits.
func (e *env) startPair(ds []driver) (first, second *mrproc.Process) {
	e.t.Helper()
	first = e.startAll(ds)
	second = mrproc.Start(e.t, e.writeConfig(ds))
	kubelet.WaitFor(e.t, registerTimeout, "the second instance to wait", func() bool { return second.Count(waitsLog, "") == 1 })
	return first, second
}

// notListening reports which sockets of ds nobody accepts on, or "" when every one listens.
func (e *env) notListening(ds []driver) string {
	var dead []string
	for _, d := range ds {
		c, err := net.DialTimeout("unix", e.socketPath(d), time.Second)
		if err != nil {
			dead = append(dead, fmt.Sprintf("%s: %v", d.name, err))
			continue
		}
		c.Close()
	}
	return strings.Join(dead, "\n")
}

// takeOver stops first with SIGTERM and waits until second has registered every driver of ds
// anew, on sockets that listen.
func (e *env) takeOver(first, second *mrproc.Process, ds []driver) {
	e.t.Helper()
	before := e.snap(ds)
	first.Signal(e.t, syscall.SIGTERM)
	if code := first.Wait(e.t, exitTimeout); code != 0 {
		e.t.Errorf("first instance: exit code %d after SIGTERM", code)
	}
	kubelet.WaitFor(e.t, registerTimeout, "the second instance to take over and register every driver again", func() bool {
		for _, d := range ds {
			if e.k.Counts(d.name).Registrations <= before.counts[d.name].Registrations || !e.k.Registered(d.name) {
				return false
			}
		}
		return second.Count("took over the registration directory", "") == 1
	})
	waitPhases(e.t, second, ds, "Registered")
	if dead := e.notListening(ds); dead != "" {
		e.t.Errorf("sockets nobody listens on after the take-over:\n%s", dead)
	}
}

// Fault: while a second instance waits, the lock file of the registration directory is
// deleted, or the directory is recreated (and a SIGHUP reaches the waiting instance). The
// first instance keeps the directory: it locks the new lock file, the waiting one never
// serves, and the registrations are untouched (deleted lock file) or renewed by the first
// instance alone (directory recreated, which removed the sockets). Once the first exits, the
// second takes over with every socket listening.
func TestLockHarmedWhileAnotherWaits(t *testing.T) {
	t.Parallel()
	for _, harm := range []string{"lock deleted", "directory recreated"} {
		t.Run(harm, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := mixed("w", 4)
			first, second := e.startPair(ds)
			second.Signal(t, syscall.SIGHUP) // signals are handled from the first instant
			before := e.snap(ds)
			switch harm {
			case "lock deleted":
				if err := os.Remove(filepath.Join(e.reg, ".multireg.lock")); err != nil {
					t.Fatal(err)
				}
			case "directory recreated":
				// kubelet's watch dies with the directory, as a real kubelet's does: it
				// restarts and registers every driver on the new sockets.
				e.recreateRegistry()
				kubelet.WaitFor(t, registerTimeout, "every socket published in the new directory", func() bool {
					for _, d := range ds {
						if !isSocket(e.socketPath(d)) || idOf(e.socketPath(d)) == before.ids[d.name] {
							return false
						}
					}
					return true
				})
				e.restartKubelet()
				e.waitRegistered(first, ds)
				before = e.snap(ds)
			}
			// Longer than the waiting instance's grace and settle together (3 s + 2 s).
			kubelet.Never(t, 7*time.Second, "the waiting instance served, exited, or a driver moved", func() bool {
				if m := e.moved(before, ds); m != "" {
					t.Log(m)
					return true
				}
				return second.HTTPAddr() != "" || second.Count("registration socket published", "") != 0 || second.Exited() || first.Exited()
			})
			if dead := e.notListening(ds); dead != "" {
				t.Errorf("sockets nobody listens on:\n%s", dead)
			}
			e.takeOver(first, second, ds)
		})
	}
}

// Fault: the instance that holds the registration directory is stopped (SIGSTOP: a frozen or
// starved process) and its lock file deleted. The waiting instance takes the directory after
// its grace and registers every driver; when the first resumes, it finds the directory lost
// and exits 1 without touching a socket: every registration stays the second's.
func TestStalledHolderLosesTheDirectory(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := mixed("s", 4)
	first, second := e.startPair(ds)
	before := e.snap(ds)
	first.Signal(t, syscall.SIGSTOP)
	t.Cleanup(func() { syscall.Kill(first.PID(), syscall.SIGCONT) }) // if the test ends early
	if err := os.Remove(filepath.Join(e.reg, ".multireg.lock")); err != nil {
		t.Fatal(err)
	}
	kubelet.WaitFor(t, registerTimeout, "the second instance to take over and register every driver again", func() bool {
		for _, d := range ds {
			if e.k.Counts(d.name).Registrations <= before.counts[d.name].Registrations || !e.k.Registered(d.name) {
				return false
			}
		}
		return second.Count("took over the registration directory", "") == 1
	})
	waitPhases(t, second, ds, "Registered")
	taken := e.snap(ds)

	first.Signal(t, syscall.SIGCONT)
	if code := first.Wait(t, exitTimeout); code != 1 {
		t.Errorf("the instance that lost the directory: exit code %d, want 1", code)
	}
	if first.Count("stopping without touching the sockets: another instance serves this directory now", "") != 1 {
		t.Error("the instance that lost the directory did not say why it stopped")
	}
	if n := first.Count("registration socket published", ""); n != len(ds) {
		t.Errorf("the instance that lost the directory published %d sockets, want only its first %d", n, len(ds))
	}
	e.holdUnmoved(taken, ds)
	if dead := e.notListening(ds); dead != "" {
		t.Errorf("sockets nobody listens on:\n%s", dead)
	}
	if second.Exited() {
		t.Error("the second instance exited")
	}
}
