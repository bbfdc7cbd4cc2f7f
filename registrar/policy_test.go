package registrar

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestPolicyGoesOnWhereTheCurveStood: a new loop policy replays the failures since the last
// registration on the new backoff, and keeps a timeout grown after timeouts grown by as much
// over the new registrationTimeout, within its bound; an ungrown one is the new one.
func TestPolicyGoesOnWhereTheCurveStood(t *testing.T) {
	old := config.Driver{Policy: config.Policy{RegistrationTimeout: time.Second, Backoff: config.Backoff{InitialInterval: time.Second, MaxInterval: time.Hour, Multiplier: 2}}}
	p := newPacing(old)
	for range 3 { // 1s, 2s, 4s
		p.wait()
	}
	p.timedOut() // 2s
	p.timedOut() // 4s: four times the configured timeout
	now := old
	now.Backoff = config.Backoff{InitialInterval: 10 * time.Second, MaxInterval: time.Hour, Multiplier: 3}
	now.RegistrationTimeout = 10 * time.Second
	p.setPolicy(now)
	if got, want := p.wait(), 270*time.Second; got != want { // 10s, 30s, 90s replayed
		t.Errorf("the wait after three failures under the new policy: %s, want %s", got, want)
	}
	if got, want := p.timeout, 40*time.Second; got != want {
		t.Errorf("timeout in force %s, want %s (four times the new one)", got, want)
	}
	now.RegistrationTimeout = time.Second
	p.setPolicy(now)
	if got, want := p.timeout, 4*time.Second; got != want {
		t.Errorf("timeout in force %s, want %s", got, want)
	}
	p.registered()
	now.RegistrationTimeout = 5 * time.Second
	p.setPolicy(now)
	if p.timeout != 5*time.Second || p.failures != 0 {
		t.Errorf("after a registration and a new policy: timeout %s, %d failures; want 5s, none", p.timeout, p.failures)
	}
	now.RegistrationTimeout = 0
	p.setPolicy(now)
	if p.timeout != 0 {
		t.Errorf("a disabled timeout is %s in force", p.timeout)
	}
}

// TestHandOverWithAnotherLoopPolicyKeepsEverySocket: the new instance's drivers differ from the
// ones handed over in loop policy only (backoff, registrationTimeout, waitForEndpoint,
// required): every socket is taken over, and kubelet sees nothing.
func TestHandOverWithAnotherLoopPolicyKeepsEverySocket(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)
	edited := slices.Clone(ds)
	for i := range edited {
		edited[i].Backoff = config.Backoff{InitialInterval: 3 * time.Second, MaxInterval: time.Minute, Multiplier: 3, RandomizationFactor: 0.1}
		edited[i].RegistrationTimeout = 30 * time.Second
		edited[i].WaitForEndpoint = i%2 == 0
		edited[i].Required = true
	}
	b := startMultireg(t, reg, edited)
	a.handedOver(t)
	if n := b.sup.TakenOver(); n != len(ds) {
		t.Errorf("%d sockets taken over, want %d", n, len(ds))
	}
	for _, d := range ds {
		testkit.Eventually(t, 5*time.Second, d.Name+" Registered in the new instance", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
		if st := statusOf(b.sup, d.Name); st.Attempts != 1 || !st.Required {
			t.Errorf("%s: %+v, want the first instance's one attempt, required", d.Name, st)
		}
	}
	if now := ids(t, ds); !slices.Equal(now, before) {
		t.Errorf("sockets replaced: %v, were %v", now, before)
	}
}

// TestPolicyReachesEveryWait: a loop policy edited while the loop waits — for an endpoint that
// does not answer (also taking a handed socket over, and while a restarted driver comes up),
// through a backoff, for kubelet's verdict — takes effect at once, not when the wait under way
// ends (a minute here): the edit ends the wait, and the wait begins again under the new
// policy. The time each took is logged.
func TestPolicyReachesEveryWait(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver)
		edit  func(config.Driver) config.Driver
		done  func(s *Supervisor, d config.Driver) bool
	}{{
		// The documented way out for a driver multireg cannot probe: waitForEndpoint false.
		name: "WaitingForEndpoint",
		setup: func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver) {
			s, d := setupWaiting(t, config.DevicePlugin, slowBackoff)
			if err := os.MkdirAll(filepath.Dir(d.LocalEndpoint), 0o755); err != nil {
				t.Fatal(err)
			}
			deadSocket(t, d.LocalEndpoint)
			testkit.Eventually(t, 5*time.Second, "waiting for the endpoint", func() bool {
				return strings.Contains(statusOf(s, d.Name).LastError, "connection refused")
			})
			return s, d
		},
		edit: func(d config.Driver) config.Driver { d.WaitForEndpoint = false; return d },
		done: func(s *Supervisor, d config.Driver) bool { return testkit.IsSocket(d.SocketPath) },
	}, {
		name: "TakingOver",
		setup: func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver) {
			dir := testkit.ShortDir(t)
			d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, filepath.Join(dir, "ep", "dp.sock"))
			slowBackoff(&d)
			if err := os.MkdirAll(filepath.Dir(d.LocalEndpoint), 0o755); err != nil {
				t.Fatal(err)
			}
			deadSocket(t, d.LocalEndpoint)
			id, f := handedSocket(t, d)
			s := runSupervisor(t, Options{Log: log.Logger()})
			s.TakeOver(handedWith(d, id, f, true, id))
			s.Start(d)
			testkit.Eventually(t, 5*time.Second, "taking over, the endpoint not answering", func() bool {
				return strings.Contains(statusOf(s, d.Name).LastError, "connection refused")
			})
			return s, d
		},
		edit: func(d config.Driver) config.Driver { d.WaitForEndpoint = false; return d },
		done: func(s *Supervisor, d config.Driver) bool {
			return statusOf(s, d.Name).Phase == Registered && statusOf(s, d.Name).LastError == ""
		},
	}, {
		name: "Restarting",
		setup: func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver) {
			s, d, e := registeredCSINode(t, log, "node-a")
			d.Backoff = config.Backoff{InitialInterval: time.Minute, MaxInterval: time.Minute, Multiplier: 2}
			s.Update(d)
			crash(t, s, d, e)
			deadSocket(t, d.LocalEndpoint) // the driver restarted, and does not answer yet
			testkit.Eventually(t, 5*time.Second, "the restarted driver not answering", func() bool {
				return strings.Contains(statusOf(s, d.Name).LastError, "connection refused")
			})
			return s, d
		},
		edit: func(d config.Driver) config.Driver { d.WaitForEndpoint = false; return d },
		done: func(s *Supervisor, d config.Driver) bool { return statusOf(s, d.Name).Attempts == 2 },
	}, {
		name: "BackingOff",
		setup: func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver) {
			s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, slowBackoff)
			awaitSocket(t, d)
			register(t, d.SocketPath, false, "no")
			testkit.Eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
			return s, d
		},
		edit: func(d config.Driver) config.Driver { return withPolicy(d, 50*time.Millisecond, 0) },
		done: func(s *Supervisor, d config.Driver) bool { return statusOf(s, d.Name).Attempts == 2 },
	}, {
		name: "AwaitingVerdict",
		setup: func(t *testing.T, log *testkit.Buffer) (*Supervisor, config.Driver) {
			s, d, _ := setupOpts(t, config.CSIPlugin, true, Options{Log: log.Logger()}, slowBackoff)
			awaitSocket(t, d)
			return s, d
		},
		edit: func(d config.Driver) config.Driver { return withPolicy(d, time.Minute, time.Second) },
		done: func(s *Supervisor, d config.Driver) bool { return statusOf(s, d.Name).Results[ResultTimeout] == 1 },
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var log testkit.Buffer
			s, d := tc.setup(t, &log)
			at := time.Now()
			s.Update(tc.edit(d))
			testkit.Eventually(t, 10*time.Second, "the new policy in force", func() bool { return tc.done(s, d) })
			t.Logf("in force %s after the edit", time.Since(at).Round(time.Millisecond))
		})
	}
}
