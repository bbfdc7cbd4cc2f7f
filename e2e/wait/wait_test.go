package wait

import (
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
