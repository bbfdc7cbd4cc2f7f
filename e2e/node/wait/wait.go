// Package wait polls a condition with a deadline, for the node tests and their helpers: what
// they wait for (another process's exit, a daemon answering) gives no event to wait on.
package wait

import "time"

// Until calls cond every interval until it returns true, and reports whether it did before
// timeout passed. cond runs at least once.
func Until(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		<-tick.C
	}
	return true
}
