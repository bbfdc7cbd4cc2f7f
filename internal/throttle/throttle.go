// Package throttle keeps a recurring warning from flooding the log: the first is logged, then
// one per interval at most, saying how many came since the last one logged. Floods of
// connections and requests, which multireg refuses or cuts by the thousand a second, are what
// it is for.
package throttle

import (
	"sync"
	"time"
)

// Interval is how often multireg logs one kind of recurring warning at most.
const Interval = 10 * time.Second

// Warning throttles one kind of warning to one per Every. The zero Every logs them all. It is
// safe for concurrent use.
type Warning struct {
	Every time.Duration

	// guards: logged, count.
	mu     sync.Mutex
	logged time.Time // when the last one was logged; zero before the first
	count  int       // since then, the one being noted included
}

// Note counts one occurrence and reports whether to log it, with how many occurred since the
// last one logged, this one included (1 when none was held back).
func (w *Warning) Note() (log bool, n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.count++
	now := time.Now()
	if !w.logged.IsZero() && now.Sub(w.logged) < w.Every {
		return false, w.count
	}
	n, w.count, w.logged = w.count, 0, now
	return true, n
}
