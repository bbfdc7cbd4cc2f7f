package registrar

import (
	"slices"
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
