// Package pause waits, bounded by a context: what the loops that retry with a backoff, and
// the node condition's processes, wait with between two attempts.
package pause

import (
	"context"
	"time"
)

// For waits d, and reports false when ctx ended first.
func For(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
