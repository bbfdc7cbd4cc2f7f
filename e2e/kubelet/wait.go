package kubelet

import (
	"testing"
	"time"
)

// pollInterval is well below kubelet's 1 s reconciler period.
const pollInterval = 20 * time.Millisecond

// WaitFor polls cond until it is true and fails the test if it is still false after timeout.
// what names the awaited state in the failure message. Call it from the test's goroutine.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if cond() {
		return
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			if cond() {
				return
			}
		case <-deadline.C:
			if cond() {
				return
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
	}
}

// Never polls cond for the whole of d and fails the test as soon as it is true: an assertion
// that something does not happen, whose wait is bounded by d. Call it from the test's goroutine.
func Never(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	start := time.Now()
	if cond() {
		t.Fatalf("%s, and it should not have", what)
	}
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			if cond() {
				t.Fatalf("%s after %v, and it should not have within %v", what, time.Since(start).Round(time.Millisecond), d)
			}
		case <-deadline.C:
			if cond() {
				t.Fatalf("%s after %v, and it should not have within %v", what, d, d)
			}
			return
		}
	}
}
