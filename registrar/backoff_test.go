package registrar

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"multireg.dev/multireg/config"
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
		d := &driver{}
		start := time.Now()
		if woken, ok := d.sleep(context.Background(), 90*time.Second, nil); woken || !ok {
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
		if _, ok := d.sleep(ctx, time.Hour, nil); ok {
			t.Error("sleep went on after its context ended")
		}
		if got := time.Since(start); got != 5*time.Second {
			t.Errorf("sleep ended %s after start, want 5s (when the context ended)", got)
		}
	})
}
