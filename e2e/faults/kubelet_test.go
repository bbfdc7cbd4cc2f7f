package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: kubelet rejects a driver's registration (RegisterPlugin fails) three times in a row.
// The driver is registered in the end, on 1.35 only because multireg recreates its socket;
// the other drivers see no call at all.
func TestKubeletRejects(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"CSIPlugin", "DRAPlugin", "DevicePlugin"} {
		t.Run(typ, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("r", 6)
			victim := driver{Name: "victim.example.com", Type: typ}
			if typ == "DevicePlugin" {
				victim.Name = "example.com/victim"
			}
			e.StartEndpoints(ds)
			// The victim's endpoint comes once the others are in: its registration starts after
			// the snapshot.
			p := mrproc.Start(t, e.WriteConfig(append(ds, victim)))
			e.waitRegistered(p, ds)
			before := e.snap(ds)

			const n = 3
			e.K.FailRegistrations(victim.Name, n)
			e.StartEndpoint(victim)
			wait.For(t, registerTimeout, "the victim registered after three rejections", func() bool {
				return e.K.Registered(victim.Name) && e.K.Counts(victim.Name).RegistrationFailures == n
			})
			waitPhases(t, p, []driver{victim}, "Registered")
			if c := e.K.Counts(victim.Name); c.Registrations != 1 || c.RegistrationFailures != n {
				t.Errorf("victim: %+v, want %d failures and one registration", c, n)
			}
			waitCount(t, p, "registration failed", victim.Name, n)
			m := p.Metrics(t)
			for series, want := range map[string]float64{
				fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="rejected"}`, victim.Name):   n,
				fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="registered"}`, victim.Name): 1,
				fmt.Sprintf(`multireg_socket_recreations_total{driver=%q,reason="rejected"}`, victim.Name):      n,
			} {
				if got := mrproc.Metric(m, series); got != want {
					t.Errorf("%s = %v, want %v", series, got, want)
				}
			}
			e.assertUnmoved(before, ds)
			e.holdUnmoved(before, ds)
		})
	}
}

// Fault: kubelet restarts (a new plugin manager, with empty state, on the same directory).
// Every driver is registered again by the new kubelet on the sockets that are there; multireg
// is untouched: same process, no socket recreated, no failure.
func TestKubeletRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("k", 9)
	p := e.startAll(ds)
	pid := pidOf(t, e.Cfg)
	ids := e.snap(ds).ids
	published := p.Count("registration socket published", "")

	e.K.Stop()
	if !p.Healthy(t) {
		t.Error("/healthz not 200 while kubelet is down")
	}
	e.StartKubelet()
	wait.For(t, registerTimeout, "every driver registered by the restarted kubelet", func() bool { return e.AllRegistered(ds) })
	waitPhases(t, p, ds, "Registered")
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != 1 || c.Deregistrations != 0 || c.RegistrationFailures != 0 {
			t.Errorf("%s in the new kubelet: %+v, want one registration", d.Name, c)
		}
	}
	wait.Never(t, quietPeriod, "multireg moved after the kubelet restart", func() bool {
		for _, d := range ds {
			if fileid.Of(e.SocketPath(d)) != ids[d.Name] {
				t.Logf("%s: socket recreated", d.Name)
				return true
			}
		}
		return p.Exited() || p.Count("registration socket published", "") != published
	})
	if got := pidOf(t, e.Cfg); got != pid {
		t.Errorf("multireg pid %d → %d", pid, got)
	}
	if n := p.Count("registration failed", ""); n != 0 {
		t.Errorf("multireg logged %d registration failures", n)
	}
}

// Fault: kubelet is down while multireg starts. multireg publishes every socket and waits;
// the kubelet that comes later registers every driver on those sockets.
func TestKubeletDownAtStart(t *testing.T) {
	t.Parallel()
	e := newEnvWithoutKubelet(t)
	ds := testenv.Mixed("d", 9)
	e.StartEndpoints(ds)
	p := mrproc.Start(t, e.WriteConfig(ds))
	waitPhases(t, p, ds, "Serving")
	ids := map[string]fileid.ID{}
	for _, d := range ds {
		if !testenv.IsSocket(e.SocketPath(d)) {
			t.Fatalf("%s: no socket", d.Name)
		}
		ids[d.Name] = fileid.Of(e.SocketPath(d))
	}
	wait.Never(t, quietPeriod, "multireg left Serving with no kubelet", func() bool {
		for _, ph := range phases(t, p) {
			if ph != "Serving" {
				return true
			}
		}
		return false
	})

	e.StartKubelet()
	e.waitRegistered(p, ds)
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want one registration", d.Name, c)
		}
		if fileid.Of(e.SocketPath(d)) != ids[d.Name] {
			t.Errorf("%s: socket recreated", d.Name)
		}
	}
}

// Fault: kubelet never sends its verdict in time. A device plugin with registrationTimeout 2s
// meets a RegisterPlugin that takes 6 s: kubelet's NotifyRegistrationStatus comes after
// multireg has given up on that socket, so it reaches a closed connection (on 1.36 kubelet
// then deregisters; on 1.35 it only logs). multireg counts a timeout, says so in /status, and
// recreates its socket; once kubelet is fast again the driver is registered and stays so.
// The other drivers see nothing.
func TestRegistrationTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("t", 6)
	victim := driver{Name: "example.com/late", Type: "DevicePlugin", Extra: "    registrationTimeout: 2s\n"}
	p, before := e.startBeside(ds, victim)

	e.K.SetRegisterDelay(victim.Name, 6*time.Second)
	e.StartEndpoint(victim)
	timeouts := fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="timeout"}`, victim.Name)
	wait.Every(t, requestPoll, registerTimeout, "multireg to count a registration timeout", func() bool {
		return mrproc.Metric(p.Metrics(t), timeouts) >= 1
	})
	const why = "no registration verdict from kubelet within 2s"
	wait.Every(t, requestPoll, registerTimeout, "multireg to log the timeout", func() bool { return countWithErr(p, "registration failed", victim.Name, why) >= 1 })
	wait.Every(t, requestPoll, registerTimeout, "/status to give the timeout as the reason", func() bool {
		d, _ := p.Status(t).Driver(victim.Name)
		return strings.Contains(d.LastError, why) && d.Failures >= 1
	})

	// kubelet is fast again (the call already delayed still takes its 6 s).
	e.K.SetRegisterDelay(victim.Name, 0)
	registered := func() bool {
		es := e.K.EventsFor(victim.Name)
		d, _ := p.Status(t).Driver(victim.Name)
		return e.K.Registered(victim.Name) && len(es) > 0 && es[len(es)-1].Kind == kubelet.EventRegister && d.Phase == "Registered"
	}
	// The call delayed before still ends with a verdict that kubelet's client sends on a new
	// connection to the same path, that is to a newer socket (see TestStaleVerdict): wait
	// until the registration holds.
	waitStable(t, 60*time.Second, "the late driver registered, for good, once kubelet answers in time", registered)
	e.assertUnmoved(before, ds)
}

// Fault: kubelet's RegisterPlugin of one CSI driver (a slow NodeGetInfo) always takes 2.5 s,
// longer than the driver's registrationTimeout of 1 s. Each timeout lets multireg's next
// attempt wait longer, so the driver ends Registered, for good, while kubelet stays that slow.
// The other drivers see nothing.
func TestSlowRegistrationCompletes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("l", 6)
	victim := driver{Name: "slow.csi.example.com", Type: "CSIPlugin", Extra: "    registrationTimeout: 1s\n"}
	p, before := e.startBeside(ds, victim)

	e.K.SetRegisterDelay(victim.Name, 2500*time.Millisecond)
	e.StartEndpoint(victim)
	waitStable(t, 60*time.Second, "the slow driver registered, for good", func() bool {
		d, _ := p.Status(t).Driver(victim.Name)
		return e.K.Registered(victim.Name) && d.Phase == "Registered"
	})
	timeouts := fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="timeout"}`, victim.Name)
	n := mrproc.Metric(p.Metrics(t), timeouts)
	if n < 1 {
		t.Errorf("%s = %v: registered without a timeout, so the test proved nothing", timeouts, n)
	}
	t.Logf("registered after %v timeouts; kubelet: %+v", n, e.K.Counts(victim.Name))
	e.assertUnmoved(before, ds)
}

// Fault: a slow kubelet: RegisterPlugin of one CSI driver takes 30 s (a slow NodeGetInfo).
// The other drivers register meanwhile, and so does a driver added by a reload while the slow
// one still waits; the slow one is registered once kubelet is done.
func TestSlowKubeletDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("s", 8)
	slow := driver{Name: "slow.csi.example.com", Type: "CSIPlugin"}
	added := driver{Name: "added.csi.example.com", Type: "CSIPlugin"}
	const delay = 30 * time.Second
	e.K.SetRegisterDelay(slow.Name, delay)
	e.StartEndpoints(append(ds, slow, added))
	start := time.Now()
	p := mrproc.Start(t, e.WriteConfig(append(ds, slow)))
	const bound = 15 * time.Second // well under the 30 s the slow one takes
	wait.For(t, bound, "the other drivers registered while the slow one waits", func() bool { return e.AllRegistered(ds) })
	waitPhases(t, p, ds, "Registered")
	e.WriteConfig(append(ds, slow, added))
	wait.For(t, bound, "a driver added meanwhile registered", func() bool { return e.K.Registered(added.Name) })
	if e.K.Registered(slow.Name) {
		t.Fatalf("the slow driver registered after %v, before its %v delay", time.Since(start), delay)
	}
	if d, _ := p.Status(t).Driver(slow.Name); d.Phase != "Serving" {
		t.Errorf("the slow driver's phase %q while kubelet registers it, want Serving", d.Phase)
	}
	before := e.snap(append(ds, added))
	wait.For(t, delay+registerTimeout, "the slow driver registered", func() bool { return e.K.Registered(slow.Name) })
	waitPhases(t, p, []driver{slow}, "Registered")
	if c := e.K.Counts(slow.Name); c.Registrations != 1 || c.RegistrationFailures != 0 {
		t.Errorf("slow driver: %+v, want one registration", c)
	}
	e.assertUnmoved(before, append(ds, added))
}

// startBeside runs multireg on ds and victim, with the endpoints of ds up and registered, and
// returns it with a snapshot of ds. The victim's endpoint is not started.
func (e *env) startBeside(ds []driver, victim driver) (*mrproc.Process, snapshot) {
	e.T.Helper()
	e.StartEndpoints(ds)
	p := mrproc.Start(e.T, e.WriteConfig(append(ds, victim)))
	e.waitRegistered(p, ds)
	return p, e.snap(ds)
}
