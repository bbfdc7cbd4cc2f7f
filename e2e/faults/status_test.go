package faults

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
)

// What multireg says about its drivers, in /status and in its log, awaited.

// phases returns every driver's phase from /status.
func phases(t testing.TB, p *mrproc.Process) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, d := range p.Status(t).Drivers {
		m[d.Name] = d.Phase
	}
	return m
}

// waitPhases waits until /status shows every driver of ds in phase.
func waitPhases(t testing.TB, p *mrproc.Process, ds []driver, phase string) {
	t.Helper()
	var last map[string]string
	wait.Every(t, requestPoll, registerTimeout, fmt.Sprintf("%d drivers %s in multireg's /status", len(ds), phase), func() bool {
		last = phases(t, p)
		for _, d := range ds {
			if last[d.Name] != phase {
				return false
			}
		}
		return true
	})
}

// waitDriver waits until the driver's /status entry satisfies cond, and returns it.
func waitDriver(t testing.TB, p *mrproc.Process, name, what string, cond func(mrproc.DriverStatus) bool) mrproc.DriverStatus {
	t.Helper()
	return waitDriverWithin(t, p, name, registerTimeout, what, cond)
}

// waitDriverWithin is waitDriver with its own limit.
func waitDriverWithin(t testing.TB, p *mrproc.Process, name string, limit time.Duration, what string, cond func(mrproc.DriverStatus) bool) mrproc.DriverStatus {
	t.Helper()
	var last mrproc.DriverStatus
	wait.Every(t, requestPoll, limit, name+": "+what, func() bool {
		d, ok := p.Status(t).Driver(name)
		last = d
		return ok && cond(d)
	})
	return last
}

// waitCount waits until the process has logged msg (for driver, if not "") want times — a line
// reaches the test a moment after the process wrote it — and fails if it logged it more often.
func waitCount(t testing.TB, p *mrproc.Process, msg, driver string, want int) {
	t.Helper()
	wait.Every(t, requestPoll, registerTimeout, fmt.Sprintf("%d %q log lines", want, msg), func() bool { return p.Count(msg, driver) >= want })
	if got := p.Count(msg, driver); got != want {
		t.Errorf("%d %q log lines, want %d", got, msg, want)
	}
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

// waitStable waits until cond has held for quietPeriod without a break, within timeout.
func waitStable(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var since time.Time // when cond last became true
	for {
		switch {
		case !cond():
			since = time.Time{}
		case since.IsZero():
			since = time.Now()
		case time.Since(since) >= quietPeriod:
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s (for %v)", timeout, what, quietPeriod)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
