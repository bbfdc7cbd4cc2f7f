package faults

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: two multireg of a release without hand-overs start at once on one registration
// directory. One serves, the other waits without touching anything (it serves no socket and
// answers HTTP as a standby); when the first exits — by SIGTERM, or killed — the second takes
// over and every driver is registered on its sockets.
func TestTwoInstances(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("i", 6)
			e.StartEndpoints(ds)
			cfg := e.WriteConfig(ds)
			a, b := mrproc.StartWith(t, noHandover, cfg), mrproc.StartWith(t, noHandover, cfg)
			const waits = "another multireg holds the registration directory; waiting for it to exit"
			var first, second *mrproc.Process
			wait.For(t, registerTimeout, "one instance to serve and the other to wait", func() bool {
				switch {
				case a.Count(serving, "") == 1 && b.Count(waits, "") == 1:
					first, second = a, b
				case b.Count(serving, "") == 1 && a.Count(waits, "") == 1:
					first, second = b, a
				}
				return first != nil
			})
			e.waitRegistered(first, ds)
			before := e.snap(ds)
			wait.Never(t, quietPeriod, "the waiting instance did something", func() bool {
				return second.Count(serving, "") != 0 || second.Count("registration socket published", "") != 0 || second.Exited() || e.moved(before, ds) != ""
			})
			for _, d := range ds {
				if c := e.K.Counts(d.Name); c.Registrations != 1 {
					t.Errorf("%s: %+v, want one registration", d.Name, c)
				}
			}

			if st := second.Status(t); st.Instance.Role != "standby" {
				t.Errorf("the waiting instance's role: %q, want standby", st.Instance.Role)
			}
			first.Signal(t, sig)
			code := first.Wait(t, exitTimeout)
			if sig == syscall.SIGTERM && code != 0 {
				t.Errorf("first instance: exit code %d after SIGTERM", code)
			}
			wait.For(t, registerTimeout, "the second instance to take over and register every driver again", func() bool {
				for _, d := range ds {
					if e.K.Counts(d.Name).Registrations != 2 || !e.K.Registered(d.Name) {
						return false
					}
				}
				return second.Count("took over the registration directory", "") == 1
			})
			waitPhases(t, second, ds, "Registered")
			for _, d := range ds {
				if fileid.Of(e.Socket(d)) == before.ids[d.Name] {
					t.Errorf("%s: still the first instance's socket", d.Name)
				}
			}
			if second.Exited() {
				t.Error("the second instance exited")
			}
		})
	}
}

// waitsLog is what an instance logs while another holds the registration directory; serving
// what it logs once it holds it.
const (
	waitsLog = "another multireg holds the registration directory; waiting for it to exit"
	serving  = "serving the registration directory"
)

// noHandover runs multireg as a release without hand-overs: it neither serves nor asks for
// one, and an instance that finds the directory held waits for the lock.
var noHandover = mrproc.Options{Env: []string{"MULTIREG_TEST_HANDOVER_PROTOCOL=0"}}

// startPair runs a registered multireg of a release without hand-overs on ds, and a second
// one on the same file, and returns both once the second says it waits.
func (e *env) startPair(ds []driver) (first, second *mrproc.Process) {
	e.T.Helper()
	e.StartEndpoints(ds)
	first = mrproc.StartWith(e.T, noHandover, e.WriteConfig(ds))
	e.waitRegistered(first, ds)
	second = mrproc.Start(e.T, e.WriteConfig(ds))
	wait.For(e.T, registerTimeout, "the second instance to wait", func() bool { return second.Count(waitsLog, "") == 1 })
	return first, second
}

// notListening reports which sockets of ds nobody accepts on, or "" when every one listens.
func (e *env) notListening(ds []driver) string {
	var dead []string
	for _, d := range ds {
		c, err := net.DialTimeout("unix", e.Socket(d), time.Second)
		if err != nil {
			dead = append(dead, fmt.Sprintf("%s: %v", d.Name, err))
			continue
		}
		c.Close()
	}
	return strings.Join(dead, "\n")
}

// takeOver stops first with SIGTERM and waits until second has registered every driver of ds
// anew, on sockets that listen.
func (e *env) takeOver(first, second *mrproc.Process, ds []driver) {
	e.T.Helper()
	before := e.snap(ds)
	first.Signal(e.T, syscall.SIGTERM)
	if code := first.Wait(e.T, exitTimeout); code != 0 {
		e.T.Errorf("first instance: exit code %d after SIGTERM", code)
	}
	wait.For(e.T, registerTimeout, "the second instance to take over and register every driver again", func() bool {
		for _, d := range ds {
			if e.K.Counts(d.Name).Registrations <= before.counts[d.Name].Registrations || !e.K.Registered(d.Name) {
				return false
			}
		}
		return second.Count("took over the registration directory", "") == 1
	})
	waitPhases(e.T, second, ds, "Registered")
	if dead := e.notListening(ds); dead != "" {
		e.T.Errorf("sockets nobody listens on after the take-over:\n%s", dead)
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
			ds := testenv.Mixed("w", 4)
			first, second := e.startPair(ds)
			second.Signal(t, syscall.SIGHUP) // signals are handled from the first instant
			before := e.snap(ds)
			switch harm {
			case "lock deleted":
				if err := os.Remove(filepath.Join(e.Reg, ".multireg.lock")); err != nil {
					t.Fatal(err)
				}
			case "directory recreated":
				// kubelet's watch dies with the directory, as a real kubelet's does: it
				// restarts and registers every driver on the new sockets.
				e.RecreateRegistry()
				wait.For(t, registerTimeout, "every socket published in the new directory", func() bool {
					for _, d := range ds {
						if !testenv.IsSocket(e.Socket(d)) || fileid.Of(e.Socket(d)) == before.ids[d.Name] {
							return false
						}
					}
					return true
				})
				e.RestartKubelet()
				e.waitRegistered(first, ds)
				before = e.snap(ds)
			}
			// Longer than the waiting instance's grace and settle together (3 s + 2 s).
			wait.Never(t, 7*time.Second, "the waiting instance served, exited, or a driver moved", func() bool {
				if m := e.moved(before, ds); m != "" {
					t.Log(m)
					return true
				}
				return second.Count(serving, "") != 0 || second.Count("registration socket published", "") != 0 || second.Exited() || first.Exited()
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
	ds := testenv.Mixed("s", 4)
	first, second := e.startPair(ds)
	before := e.snap(ds)
	first.Signal(t, syscall.SIGSTOP)
	t.Cleanup(func() { syscall.Kill(first.PID(), syscall.SIGCONT) }) // if the test ends early
	if err := os.Remove(filepath.Join(e.Reg, ".multireg.lock")); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "the second instance to take over and register every driver again", func() bool {
		for _, d := range ds {
			if e.K.Counts(d.Name).Registrations <= before.counts[d.Name].Registrations || !e.K.Registered(d.Name) {
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
