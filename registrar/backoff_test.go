package registrar

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"testing"
	"testing/synctest"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

func TestBackoffCurve(t *testing.T) {
	b := newBackoff(config.Backoff{InitialInterval: time.Second, MaxInterval: 10 * time.Second, Multiplier: 2})
	want := []time.Duration{1, 2, 4, 8, 10, 10, 10}
	for i, w := range want {
		if got := next(b); got != w*time.Second {
			t.Errorf("wait %d = %s, want %s", i, got, w*time.Second)
		}
	}
	b.Reset()
	if got := next(b); got != time.Second {
		t.Errorf("after Reset: %s, want 1s", got)
	}
}

// TestBackoffNeverStops: with MaxElapsedTime 0 a driver is retried forever, long past the
// library's 15-minute default.
func TestBackoffNeverStops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBackoff(config.Backoff{InitialInterval: time.Second, MaxInterval: 2 * time.Minute, Multiplier: 2, RandomizationFactor: 0.2})
		for range 100 { // over three hours of virtual time
			w := next(b)
			if w <= 0 || w > 2*time.Minute*12/10 {
				t.Fatalf("wait %s out of bounds", w)
			}
			time.Sleep(w)
		}
	})
}

func TestBackoffJitterBounds(t *testing.T) {
	b := newBackoff(config.Backoff{InitialInterval: 10 * time.Second, MaxInterval: 10 * time.Second, Multiplier: 2, RandomizationFactor: 0.2})
	for range 1000 {
		if w := next(b); w < 8*time.Second || w > 12*time.Second {
			t.Fatalf("wait %s outside 10s ± 20%%", w)
		}
	}
}

// TestSleepWaitsTheInterval checks the loop's wait in virtual time: it returns after exactly
// the interval, and at once when the context ends.
func TestSleepWaitsTheInterval(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if woken, ok := sleepUntil(context.Background(), 90*time.Second, nil, nil); woken || !ok {
			t.Fatalf("sleep = %v, %v", woken, ok)
		}
		if got := time.Since(start); got != 90*time.Second {
			t.Errorf("slept %s, want 90s", got)
		}

		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			time.Sleep(5 * time.Second)
			cancel()
		}()
		start = time.Now()
		if _, ok := sleepUntil(ctx, time.Hour, nil, nil); ok {
			t.Error("sleep went on after its context ended")
		}
		if got := time.Since(start); got != 5*time.Second {
			t.Errorf("sleep ended %s after start, want 5s (when the context ended)", got)
		}
	})
}

// TestRegistrationTimeoutGrows: each timeout multiplies the timeout in force by the backoff's
// multiplier (at least 2), up to 32 times the configured one; a registration resets it.
func TestRegistrationTimeoutGrows(t *testing.T) {
	for _, tc := range []struct {
		multiplier float64
		base       time.Duration
		want       []time.Duration
	}{
		{2, time.Second, []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second, 32 * time.Second}},
		{1, time.Second, []time.Duration{2 * time.Second, 4 * time.Second}}, // at least 2
		{3, 2 * time.Second, []time.Duration{6 * time.Second, 18 * time.Second, 54 * time.Second, 64 * time.Second}},
		{2, 100000 * time.Hour, []time.Duration{200000 * time.Hour, 400000 * time.Hour, 800000 * time.Hour, 1600000 * time.Hour, math.MaxInt64, math.MaxInt64}}, // no overflow
	} {
		p := newPacing(config.Driver{Policy: config.Policy{RegistrationTimeout: tc.base, Backoff: config.Backoff{InitialInterval: time.Second, MaxInterval: time.Second, Multiplier: tc.multiplier}}})
		for i, w := range tc.want {
			if got := p.timedOut(); got != w {
				t.Errorf("multiplier %v, base %s: timeout after %d timeouts = %s, want %s", tc.multiplier, tc.base, i+1, got, w)
			}
		}
		p.registered()
		if p.timeout != tc.base {
			t.Errorf("multiplier %v, base %s: after a registration %s, want %s", tc.multiplier, tc.base, p.timeout, tc.base)
		}
	}
}

// TestRegistrationBackoffIndependentOfEndpointWait: a long wait for the endpoint must not
// make the first registration failure after it wait the longest interval.
func TestRegistrationBackoffIndependentOfEndpointWait(t *testing.T) {
	s, d := setupWaiting(t, config.DevicePlugin, func(d *config.Driver) {
		if err := os.MkdirAll(filepath.Dir(d.LocalEndpoint), 0o755); err != nil {
			t.Fatal(err)
		}
		d.Backoff = config.Backoff{InitialInterval: 100 * time.Millisecond, MaxInterval: 30 * time.Second, Multiplier: 4}
	})
	// 100ms, 400ms, 1.6s: after about 2 s the endpoint wait is at 6.4 s.
	testkit.Eventually(t, 10*time.Second, "a long wait for the endpoint", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && time.Until(st.NextAttempt) > 3*time.Second
	})
	startEndpoint(t, d.LocalEndpoint, "") // wakes the loop at once
	awaitSocket(t, d)
	register(t, d.SocketPath, false, "no")
	testkit.Eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
	if wait := time.Until(statusOf(s, d.Name).NextAttempt); wait > time.Second {
		t.Errorf("first registration retry in %s, want the initial interval (100ms)", wait)
	}
}
