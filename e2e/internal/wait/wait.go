// Package wait polls a condition with a deadline, for the end-to-end tests and their helpers:
// what they wait for (kubelet's 1 s reconciler, another process, a daemon answering, a file)
// gives them no event to wait on. Every function here is one loop, Poll's.
//
// For, Every and Never end the test with t.Fatalf: call them from the test's goroutine.
package wait

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// pollInterval is well below kubelet's 1 s reconciler period.
const pollInterval = 20 * time.Millisecond

// Poll calls cond every interval until it returns true, or ctx ends; the error then names
// what was awaited and the last error cond returned. cond runs at least once.
func Poll(ctx context.Context, interval time.Duration, what string, cond func() (bool, error)) error {
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			if last != nil {
				return fmt.Errorf("%s: %w (last: %v)", what, ctx.Err(), last)
			}
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-time.After(interval):
		}
	}
}

// Until calls cond every interval until it returns true, and reports whether it did before
// timeout passed. cond runs at least once.
func Until(timeout, interval time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return Poll(ctx, interval, "", func() (bool, error) { return cond(), nil }) == nil
}

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
	if !Until(timeout, interval, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// Never polls cond every 20 ms for the whole of d and fails the test as soon as it is true:
// an assertion that something does not happen, whose wait is bounded by d.
func Never(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	start := time.Now()
	if Until(d, pollInterval, cond) {
		t.Fatalf("%s after %v, and it should not have within %v", what, time.Since(start).Round(time.Millisecond), d)
	}
}
