package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
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
			ds := mixed("r", 6)
			victim := driver{name: "victim.example.com", typ: typ}
			if typ == "DevicePlugin" {
				victim.name = "example.com/victim"
			}
			for _, d := range ds {
				e.startEndpoint(d)
			}
			// The victim's endpoint comes once the others are in: its registration starts after
			// the snapshot.
			p := mrproc.Start(t, e.writeConfig(append(ds, victim)))
			e.waitRegistered(p, ds)
			before := e.snap(ds)

			const n = 3
			e.k.FailRegistrations(victim.name, n)
			e.startEndpoint(victim)
			kubelet.WaitFor(t, registerTimeout, "the victim registered after three rejections", func() bool {
				return e.k.Registered(victim.name) && e.k.Counts(victim.name).RegistrationFailures == n
			})
			waitPhases(t, p, []driver{victim}, "Registered")
			if c := e.k.Counts(victim.name); c.Registrations != 1 || c.RegistrationFailures != n {
				t.Errorf("victim: %+v, want %d failures and one registration", c, n)
			}
			waitCount(t, p, "registration failed", victim.name, n)
			m := metrics(t, p)
			for series, want := range map[string]float64{
				fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="rejected"}`, victim.name):   n,
				fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="registered"}`, victim.name): 1,
				fmt.Sprintf(`multireg_socket_recreations_total{driver=%q,reason="rejected"}`, victim.name):      n,
			} {
				if got := metric(m, series); got != want {
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
	ds := mixed("k", 9)
	p := e.startAll(ds)
	pid := pidOf(t, e.cfg)
	ids := e.snap(ds).ids
	published := p.Count("registration socket published", "")

	e.k.Stop()
	if !healthy(t, p) {
		t.Error("/healthz not 200 while kubelet is down")
	}
	e.startKubelet()
	kubelet.WaitFor(t, registerTimeout, "every driver registered by the restarted kubelet", func() bool { return e.allRegistered(ds) })
	waitPhases(t, p, ds, "Registered")
	for _, d := range ds {
		if c := e.k.Counts(d.name); c.Registrations != 1 || c.Deregistrations != 0 || c.RegistrationFailures != 0 {
			t.Errorf("%s in the new kubelet: %+v, want one registration", d.name, c)
		}
	}
	kubelet.Never(t, quietPeriod, "multireg moved after the kubelet restart", func() bool {
		for _, d := range ds {
			if idOf(e.socketPath(d)) != ids[d.name] {
				t.Logf("%s: socket recreated", d.name)
				return true
			}
		}
		return p.Exited() || p.Count("registration socket published", "") != published
	})
	if got := pidOf(t, e.cfg); got != pid {
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
	ds := mixed("d", 9)
	for _, d := range ds {
		e.startEndpoint(d)
	}
	p := mrproc.Start(t, e.writeConfig(ds))
	waitPhases(t, p, ds, "Serving")
	ids := map[string]fileID{}
	for _, d := range ds {
		if !isSocket(e.socketPath(d)) {
			t.Fatalf("%s: no socket", d.name)
		}
		ids[d.name] = idOf(e.socketPath(d))
	}
	kubelet.Never(t, quietPeriod, "multireg left Serving with no kubelet", func() bool {
		for _, ph := range phases(t, p) {
			if ph != "Serving" {
				return true
			}
		}
		return false
	})

	e.startKubelet()
	e.waitRegistered(p, ds)
	for _, d := range ds {
		if c := e.k.Counts(d.name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want one registration", d.name, c)
		}
		if idOf(e.socketPath(d)) != ids[d.name] {
			t.Errorf("%s: socket recreated", d.name)
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
	ds := mixed("t", 6)
	victim := driver{name: "example.com/late", typ: "DevicePlugin", extra: "    registrationTimeout: 2s\n"}
	p, before := e.startBeside(ds, victim)

	e.k.SetRegisterDelay(victim.name, 6*time.Second)
	e.startEndpoint(victim)
	timeouts := fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="timeout"}`, victim.name)
	poll(t, registerTimeout, "multireg to count a registration timeout", func() bool {
		return metric(metrics(t, p), timeouts) >= 1
	})
	const why = "no registration verdict from kubelet within 2s"
	poll(t, registerTimeout, "multireg to log the timeout", func() bool { return countWithErr(p, "registration failed", victim.name, why) >= 1 })
	poll(t, registerTimeout, "/status to give the timeout as the reason", func() bool {
		d, _ := status(t, p).driver(victim.name)
		return strings.Contains(d.LastError, why) && d.Failures >= 1
	})

	// kubelet is fast again (the call already delayed still takes its 6 s).
	e.k.SetRegisterDelay(victim.name, 0)
	registered := func() bool {
		es := e.k.EventsFor(victim.name)
		d, _ := status(t, p).driver(victim.name)
		return e.k.Registered(victim.name) && len(es) > 0 && es[len(es)-1].Kind == kubelet.EventRegister && d.Phase == "Registered"
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
	ds := mixed("l", 6)
	victim := driver{name: "slow.csi.example.com", typ: "CSIPlugin", extra: "    registrationTimeout: 1s\n"}
	p, before := e.startBeside(ds, victim)

	e.k.SetRegisterDelay(victim.name, 2500*time.Millisecond)
	e.startEndpoint(victim)
	waitStable(t, 60*time.Second, "the slow driver registered, for good", func() bool {
		d, _ := status(t, p).driver(victim.name)
		return e.k.Registered(victim.name) && d.Phase == "Registered"
	})
	timeouts := fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="timeout"}`, victim.name)
	n := metric(metrics(t, p), timeouts)
	if n < 1 {
		t.Errorf("%s = %v: registered without a timeout, so the test proved nothing", timeouts, n)
	}
	t.Logf("registered after %v timeouts; kubelet: %+v", n, e.k.Counts(victim.name))
	e.assertUnmoved(before, ds)
}

// Fault: a slow kubelet: RegisterPlugin of one CSI driver takes 30 s (a slow NodeGetInfo).
// The other drivers register meanwhile, and so does a driver added by a reload while the slow
// one still waits; the slow one is registered once kubelet is done.
func TestSlowKubeletDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := mixed("s", 8)
	slow := driver{name: "slow.csi.example.com", typ: "CSIPlugin"}
	added := driver{name: "added.csi.example.com", typ: "CSIPlugin"}
	const delay = 30 * time.Second
	e.k.SetRegisterDelay(slow.name, delay)
	for _, d := range append(ds, slow, added) {
		e.startEndpoint(d)
	}
	start := time.Now()
	p := mrproc.Start(t, e.writeConfig(append(ds, slow)))
	const bound = 15 * time.Second // well under the 30 s the slow one takes
	kubelet.WaitFor(t, bound, "the other drivers registered while the slow one waits", func() bool { return e.allRegistered(ds) })
	waitPhases(t, p, ds, "Registered")
	e.writeConfig(append(ds, slow, added))
	kubelet.WaitFor(t, bound, "a driver added meanwhile registered", func() bool { return e.k.Registered(added.name) })
	if e.k.Registered(slow.name) {
		t.Fatalf("the slow driver registered after %v, before its %v delay", time.Since(start), delay)
	}
	if d, _ := status(t, p).driver(slow.name); d.Phase != "Serving" {
		t.Errorf("the slow driver's phase %q while kubelet registers it, want Serving", d.Phase)
	}
	before := e.snap(append(ds, added))
	kubelet.WaitFor(t, delay+registerTimeout, "the slow driver registered", func() bool { return e.k.Registered(slow.name) })
	waitPhases(t, p, []driver{slow}, "Registered")
	if c := e.k.Counts(slow.name); c.Registrations != 1 || c.RegistrationFailures != 0 {
		t.Errorf("slow driver: %+v, want one registration", c)
	}
	e.assertUnmoved(before, append(ds, added))
}

// countWithErr counts the log records with msg and driver whose err contains substr.
func countWithErr(p *mrproc.Process, msg, driver, substr string) int {
	n := 0
	for _, r := range p.Records() {
		if r["msg"] != msg || r["driver"] != driver {
			continue
		}
		if s, _ := r["err"].(string); strings.Contains(s, substr) {
			n++
		}
	}
	return n
}

// startBeside runs multireg on ds and victim, with the endpoints of ds up and registered, and
// returns it with a snapshot of ds. The victim's endpoint is not started.
func (e *env) startBeside(ds []driver, victim driver) (*mrproc.Process, snapshot) {
	e.t.Helper()
	for _, d := range ds {
		e.startEndpoint(d)
	}
	p := mrproc.Start(e.t, e.writeConfig(append(ds, victim)))
	e.waitRegistered(p, ds)
	return p, e.snap(ds)
}
