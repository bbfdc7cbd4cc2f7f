package throttle

import (
	"testing"
	"time"
)

// TestNote: the first occurrence is logged, the next ones are held back until Every has
// passed, and the one logged then counts them all; a zero Every logs every one.
func TestNote(t *testing.T) {
	w := Warning{Every: time.Hour}
	if log, n := w.Note(); !log || n != 1 {
		t.Fatalf("the first: %v, %d; want logged, 1", log, n)
	}
	for i := range 5 {
		if log, n := w.Note(); log || n != i+1 {
			t.Fatalf("occurrence %d within Every: %v, %d; want held back, %d", i+2, log, n, i+1)
		}
	}
	w.logged = w.logged.Add(-time.Hour) // Every has passed
	if log, n := w.Note(); !log || n != 6 {
		t.Fatalf("after Every: %v, %d; want logged, 6 (five held back and this one)", log, n)
	}
	var all Warning
	for range 3 {
		if log, n := all.Note(); !log || n != 1 {
			t.Fatalf("with a zero Every: %v, %d; want every one logged", log, n)
		}
	}
}
