// Package wait polls a condition with a deadline, for the end-to-end tests: what they wait
// for (kubelet's 1 s reconciler, another process, a file) gives them no event to wait on.
// Call its functions from the test's goroutine: they end the test with t.Fatalf.
package wait

import (
	"testing"
	"time"
)

// pollInterval is well below kubelet's 1 s reconciler period.
const pollInterval = 20 * time.Millisecond

// For polls cond every 20 ms until it is true and fails the test if it is still false after
// timeout. what names the awaited state in the failure message.
func For(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	Every(t, pollInterval, timeout, what, cond)
}

// Every is For at another pace: a slower one for conditions that cost the process under test
// a request.
func Every(t testing.TB, interval, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if cond() {
		return
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(interval)
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

// Never polls cond every 20 ms for the whole of d and fails the test as soon as it is true:
// an assertion that something does not happen, whose wait is bounded by d.
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
