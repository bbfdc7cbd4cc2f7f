package registrar

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/regserver"
)

// What a driver's loop shares with the rest of the process: its configuration, what reaches
// it from other goroutines (kubelet's verdicts, a new policy) and the status it shows them
// (status.go). The loop's own state is the loop's (loop.go).

// Why a loop's context ends, as its cause.
var (
	// errRemoved: the driver left the configuration; its socket is removed.
	errRemoved = errors.New("driver removed from the configuration")
	// errShutdown: the process stops; sockets stay unless cleanup was asked for.
	errShutdown = errors.New("shutting down")
	// errHandOver: the loop's sockets and state go to another instance (internal/handover),
	// or to the loop that goes on in this process (Supervisor.move); the sockets stay,
	// listening, and the loop hands over a copy of each (handOver).
	errHandOver = errors.New("handing over to another instance")
)

// driver is one driver as its loop, the registration servers and the supervisor share it.
type driver struct {
	// spec is the driver as configured. Its Registration never changes; its Policy changes in
	// the loop's goroutine only, when the loop takes a Reload (reload).
	spec config.Driver
	log  *slog.Logger
	// changes is told of every change of st (Supervisor.Changed); nil: nobody is.
	changes *changes

	verdictC chan struct{} // capacity 1: a verdict is pending

	// guards: gen, lastGen, pending, policy, endWait, st, shown. The fields above it are set
	// before the loop starts, and spec's Policy is the loop goroutine's.
	mu      sync.Mutex
	gen     uint64             // the current socket generation; verdicts for others are dropped
	lastGen uint64             // the newest generation numbered: each socket gets its own number
	pending *regserver.Verdict // the latest verdict for gen
	policy  *config.Driver     // a loop policy not yet taken by the loop (updatePolicy)
	endWait context.CancelFunc // ends the loop's wait under way, for a new policy (beginWait)
	st      DriverStatus
	shown   shownState // what the status's phase is derived from (show)
	// local is the endpoint's socket as this process reaches it: the spec's LocalEndpoint, or
	// the pattern's match the loop registers ("" before it has one).
	local string
}

func newDriver(spec config.Driver, log *slog.Logger, ch *changes) *driver {
	defer ch.notify() // one more driver
	d := &driver{
		spec:     spec,
		changes:  ch,
		log:      log.With("driver", spec.Name),
		verdictC: make(chan struct{}, 1),
		shown:    shownState{st: stWaitingForEndpoint, waits: spec.WaitForEndpoint},
	}
	d.st = DriverStatus{
		Name:        spec.Name,
		Type:        spec.Type,
		Display:     spec.Display,
		Socket:      spec.SocketPath,
		Endpoint:    spec.Endpoint,
		Required:    spec.Required,
		Since:       time.Now(),
		Results:     map[string]int{},
		Recreations: map[string]int{},
	}
	if !spec.EndpointIsPattern() {
		d.local = spec.LocalEndpoint
	}
	d.st.Phase = d.shown.phase(WaitingForEndpoint)
	return d
}

// notify takes kubelet's verdict from a registration server. It never blocks.
func (d *driver) notify(v regserver.Verdict) {
	d.mu.Lock()
	if v.Gen != d.gen {
		d.mu.Unlock()
		d.log.Debug("verdict for an older socket ignored", "generation", v.Gen, "registered", v.Registered)
		return
	}
	d.pending = &v
	d.mu.Unlock()
	select {
	case d.verdictC <- struct{}{}:
	default:
	}
}

// takeVerdict takes the verdict pending for generation g, if any. A verdict for another
// generation is dropped: it came while the loop was leaving that socket, and is about a
// registration withdrawn since.
func (d *driver) takeVerdict(g *generation) *regserver.Verdict {
	d.mu.Lock()
	v := d.pending
	d.pending = nil
	d.mu.Unlock()
	if v != nil && v.Gen != g.gen {
		d.log.Debug("verdict for a socket withdrawn since ignored", "generation", v.Gen, "registered", v.Registered)
		return nil
	}
	return v
}

// makeCurrent makes g the generation whose verdicts count, dropping any pending for another.
func (d *driver) makeCurrent(g *generation) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gen != g.gen {
		d.gen, d.pending = g.gen, nil
	}
}

// nextGen numbers the generation about to be published and makes it current, before its
// socket can be dialled, so that no verdict for it is mistaken for a stale one; the attempt is
// counted before the socket is visible, so that whoever sees the socket sees the attempt too.
// It returns the number, and the generation that was current, which undoGen restores.
func (d *driver) nextGen() (gen, prev uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	prev = d.gen
	d.lastGen++
	d.gen, d.pending = d.lastGen, nil
	d.st.Attempts++
	return d.gen, prev
}

// undoGen makes prev current again after generation gen could not be published: an older
// socket may still serve (a driver restart), and its verdicts count again.
func (d *driver) undoGen(gen, prev uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gen == gen {
		d.gen = prev
	}
}

// updatePolicy gives the loop spec's loop policy and what status shows of it (its Policy and
// Display: spec registers as the loop does, so nothing is published and kubelet sees nothing).
// The status shows it at once; the loop's wait under way ends, and the loop takes the rest
// before it waits again (the Reload event). It never blocks.
func (d *driver) updatePolicy(spec config.Driver) {
	defer d.changes.notify()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Required, d.st.Display = spec.Required, spec.Display
	d.policy = &spec
	if d.endWait != nil {
		d.endWait()
	}
}

// beginWait returns the context of the loop's next wait: ctx's, which a new policy ends too
// (updatePolicy), at once when one is already waiting to be taken. end ends the wait.
func (d *driver) beginWait(ctx context.Context) (wctx context.Context, end context.CancelFunc) {
	wctx, cancel := context.WithCancel(ctx)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.policy != nil {
		cancel()
	}
	d.endWait = cancel
	return wctx, d.stopWait
}

// stopWait ends the loop's wait under way (beginWait).
func (d *driver) stopWait() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.endWait != nil {
		d.endWait()
		d.endWait = nil
	}
}

// takePolicy takes the loop policy updatePolicy gave, if any.
func (d *driver) takePolicy() *config.Driver {
	d.mu.Lock()
	defer d.mu.Unlock()
	spec := d.policy
	d.policy = nil
	return spec
}
