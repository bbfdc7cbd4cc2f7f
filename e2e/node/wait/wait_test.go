package wait

import (
	"testing"
	"time"
)

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
