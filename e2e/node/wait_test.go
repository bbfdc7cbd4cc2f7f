package node_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
)

// waitUntil polls cond every 100 ms until it holds or d passes; the failure names what was
// awaited and cond's last explanation.
func waitUntil(t *testing.T, d time.Duration, what string, cond func(ctx context.Context) (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	err := wait.Poll(ctx, 100*time.Millisecond, what, func() (bool, error) {
		ok, why := cond(ctx)
		if ok {
			return true, nil
		}
		return false, errors.New(why)
	})
	if err != nil {
		t.Fatalf("not within %s: %v", d, err)
	}
	return time.Since(start)
}

// stays checks, every 200 ms for d, that nothing moved: cond returns what moved, or "" if
// nothing did, or an error when it could not look (a request failed under load: looked at
// again next time). "Nothing else moves" is judged over a few reconcile passes, not at the
// instant the awaited change appeared; a check that never managed to look fails.
func stays(t *testing.T, d time.Duration, what string, cond func(ctx context.Context) (moved string, err error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	looked := 0
	// The poll ends before d only when something moved.
	err := wait.Poll(ctx, 200*time.Millisecond, what, func() (bool, error) {
		moved, err := cond(ctx)
		switch {
		case err != nil:
			return false, err
		case moved != "":
			t.Errorf("%s: no longer so: %s", what, moved)
			return true, nil
		}
		looked++
		return false, nil
	})
	if err != nil && looked == 0 {
		t.Errorf("could not look once in %s: %v", d, err)
	}
}

// shortfall adds up, over a poll, how long a count was seen below what it should be, and
// the longest such stretch.
type shortfall struct {
	since          time.Time // when the count was first seen short, while it is
	total, longest time.Duration
}

// observe takes one look: the count n, of want.
func (s *shortfall) observe(n, want int) {
	now := time.Now()
	switch {
	case n < want && s.since.IsZero():
		s.since = now
	case n >= want && !s.since.IsZero():
		d := now.Sub(s.since)
		s.total += d
		s.longest = max(s.longest, d)
		s.since = time.Time{}
	}
}
