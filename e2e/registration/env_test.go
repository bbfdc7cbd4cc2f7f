// Package registration runs the built multireg binary against the real kubelet plugin
// manager, on kubelet 1.36 (go.mod) and 1.35 (kube135/go.mod), as a user would: drivers
// registering, reloads of the drivers file, restarts and shutdown, a second instance.
package registration

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

func TestMain(m *testing.M) {
	if _, err := mrproc.Binary(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

const (
	registerTimeout = testenv.RegisterTimeout
	exitTimeout     = testenv.ExitTimeout
)

// env is one test's node (testenv.Env) with this package's own helpers.
type env struct{ *testenv.Env }

type driver = testenv.Driver

// newEnv makes a node with a running kubelet.
func newEnv(t *testing.T) *env { return &env{testenv.New(t)} }

// registeredAgain reports whether kubelet has registered every driver once more than the
// counts in before, and holds it registered.
func (e *env) registeredAgain(ds []driver, before map[string]int) bool {
	for _, d := range ds {
		if e.K.Counts(d.Name).Registrations != before[d.Name]+1 || !e.K.Registered(d.Name) {
			return false
		}
	}
	return true
}

// killedAfterRegistration starts the drivers' endpoints and a multireg, waits until kubelet
// and multireg hold every driver registered, and kills it (SIGKILL: its sockets stay). It
// returns kubelet's registration counts of the drivers then.
func (e *env) killedAfterRegistration(t *testing.T, ds []driver) map[string]int {
	t.Helper()
	e.StartEndpoints(ds)
	p := mrproc.Start(t, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "registered", func() bool { return registeredEverywhere(t, e, p, ds) })
	counts := e.Registrations(ds)
	p.Signal(t, syscall.SIGKILL)
	p.Wait(t, exitTimeout)
	return counts
}

// registeredByNextRun starts multireg again, after killedAfterRegistration, and waits until
// kubelet has registered every driver once more than counts says.
func (e *env) registeredByNextRun(t *testing.T, ds []driver, counts map[string]int) *mrproc.Process {
	t.Helper()
	p := mrproc.Start(t, e.Cfg)
	wait.For(t, registerTimeout, "registered once more by the next run", func() bool {
		return e.registeredAgain(ds, counts) && registeredEverywhere(t, e, p, ds)
	})
	return p
}

// registeredIn reports whether multireg's log says Registered for every driver.
func registeredIn(p *mrproc.Process, ds []driver) bool {
	for _, d := range ds {
		if p.Phase(d.Name) != "Registered" {
			return false
		}
	}
	return true
}

// holdPass holds kubelet's next reconcile pass that leaves d's registration socket registered
// between its two loops (kubelet.HoldPass), and returns once it does: what the test does next
// happens between them.
func (e *env) holdPass(t *testing.T, d driver) *kubelet.Hold {
	t.Helper()
	h := e.K.HoldPass(e.SocketPath(d), registerTimeout)
	select {
	case <-h.Holding():
	case <-time.After(registerTimeout):
		t.Fatalf("no reconcile pass of kubelet's held with %s registered", d.Name)
	}
	return h
}

// heldUntilChanged fails unless the pass h held went on because the socket's path changed.
func (e *env) heldUntilChanged(t *testing.T, h *kubelet.Hold) {
	t.Helper()
	if r := <-h.Result(); !r.Changed {
		t.Fatalf("kubelet's reconcile pass held %v went on without the socket's path changing", r.Held.Round(time.Millisecond))
	}
}
