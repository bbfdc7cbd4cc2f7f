package wait

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// fatals is a testing.TB whose Fatalf records the message and ends the goroutine, as the
// real one does.
type fatals struct {
	testing.TB
	msg string
}

func (f *fatals) Helper() {}

func (f *fatals) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// failure runs fn on its own goroutine and returns its Fatalf message, "" if none.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	f := &fatals{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	return f.msg
}

func TestUntil(t *testing.T) {
	n := 0
	if !Until(time.Minute, time.Millisecond, func() bool { n++; return n == 3 }) || n != 3 {
		t.Errorf("Until returned before the condition held, or called it %d times for 3", n)
	}
	calls := 0
	if Until(20*time.Millisecond, time.Millisecond, func() bool { calls++; return false }) {
		t.Errorf("Until reported a condition that never held")
	}
	if calls < 1 {
		t.Errorf("cond never called")
	}
}

func TestPoll(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	n := 0
	err := Poll(ctx, time.Millisecond, "the answer", func() (bool, error) {
		n++
		if n == 1 {
			return false, errors.New("first reason")
		}
		return false, nil // no reason this time: the last one given stays
	})
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "the answer") || !strings.Contains(err.Error(), "first reason") {
		t.Errorf("Poll past its context: %v; want what, the deadline and the last reason", err)
	}
	if err := Poll(context.Background(), time.Millisecond, "x", func() (bool, error) { return true, nil }); err != nil {
		t.Errorf("Poll on a condition that holds: %v", err)
	}
}

func TestFor(t *testing.T) {
	n := 0
	if msg := failure(t, func(tb testing.TB) { For(tb, time.Minute, "the third call", func() bool { n++; return n == 3 }) }); msg != "" || n != 3 {
		t.Errorf("For failed (%q) or returned after %d calls for 3", msg, n)
	}
	msg := failure(t, func(tb testing.TB) {
		Every(tb, time.Millisecond, 20*time.Millisecond, "nothing", func() bool { return false })
	})
	if !strings.Contains(msg, "timed out after 20ms waiting for nothing") {
		t.Errorf("Every on a condition that never holds: %q", msg)
	}
}

func TestNever(t *testing.T) {
	if msg := failure(t, func(tb testing.TB) { Never(tb, 50*time.Millisecond, "it happened", func() bool { return false }) }); msg != "" {
		t.Errorf("Never failed on a condition that never held: %q", msg)
	}
	n := 0
	msg := failure(t, func(tb testing.TB) { Never(tb, time.Minute, "it happened", func() bool { n++; return n == 3 }) })
	if !strings.Contains(msg, "it happened after") {
		t.Errorf("Never on a condition that came true: %q", msg)
	}
}
