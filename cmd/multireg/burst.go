//go:build linux

package main

import (
	"context"
	"log/slog"
	"runtime"
	"runtime/debug"
	"strings"
	"time"

	"multireg.dev/multireg/registrar"
)

// The start-up burst — every driver probed, published and registered within a second or two —
// leaves the heap fragmented and the stacks of thousands of short-lived goroutines allocated:
// memory the Go runtime gives back to the system only over minutes. A node's registrar must
// not stay near its limit while everything else on the node starts, so it returns that memory
// once the burst is over.
const (
	burstLook  = 500 * time.Millisecond // how often the drivers are looked at
	burstQuiet = 2 * time.Second        // no phase changed, and none awaits kubelet, for this long
	burstMax   = 2 * time.Minute        // the memory is returned by then, whatever the drivers do
)

// burstEnd says when the start-up burst is over: burstLook, burstQuiet and burstMax, the
// defaults (defaultBurstEnd), which the package's tests shorten.
type burstEnd struct {
	look, quiet, most time.Duration
}

// defaultBurstEnd is when the daemon's start-up burst is over.
func defaultBurstEnd() burstEnd {
	return burstEnd{look: burstLook, quiet: burstQuiet, most: burstMax}
}

// returnBurst returns the start-up burst's memory to the system once, when no driver has
// changed phase for end.quiet and none awaits kubelet's verdict (Serving), or end.most after
// it starts, looking at the drivers every end.look. It returns when ctx ends.
func returnBurst(ctx context.Context, drivers func() []registrar.DriverStatus, end burstEnd, log *slog.Logger) error {
	look := time.NewTicker(end.look)
	defer look.Stop()
	timeout := time.NewTimer(end.most)
	defer timeout.Stop()
	last, quiet := "", time.Now()
wait:
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timeout.C:
			break wait
		case now := <-look.C:
			sig, serving := phases(drivers())
			if sig != last {
				last, quiet = sig, now
				continue
			}
			if !serving && now.Sub(quiet) >= end.quiet {
				break wait
			}
		}
	}
	// Each collection halves the stacks that use less than a quarter of theirs: the loops'
	// and the servers', grown deep during the burst, come back to their resting size.
	for range 3 {
		runtime.GC()
	}
	debug.FreeOSMemory()
	log.Debug("start-up over: its memory is returned to the system")
	<-ctx.Done()
	return nil
}

// phases renders every driver's phase and when it began, and reports whether one awaits
// kubelet's verdict.
func phases(ds []registrar.DriverStatus) (sig string, serving bool) {
	var b strings.Builder
	for _, d := range ds {
		b.WriteString(d.Name)
		b.WriteString(string(d.Phase))
		b.WriteString(d.Since.String())
		serving = serving || d.Phase == registrar.Serving
	}
	return b.String(), serving
}
