package registrar

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/regserver"
)

// Why a loop's context ends, as its cause.
var (
	// errRemoved: the driver left the configuration; its socket is removed.
	errRemoved = errors.New("driver removed from the configuration")
	// errShutdown: the process stops; sockets stay unless cleanup was asked for.
	errShutdown = errors.New("shutting down")
	// errHandOff: the loop's sockets and state go to another instance (internal/handover); the
	// sockets stay, listening, and the loop keeps a copy of each (detach).
	errHandOff = errors.New("handing over to another instance")
)

// driver is one driver's registration loop. It owns its socket generations and every
// failure: nothing it does blocks another driver.
type driver struct {
	// spec is the driver as configured. What it registers never changes; its loop policy
	// (Backoff, RegistrationTimeout, WaitForEndpoint, Required) changes in the loop's goroutine
	// only, when the loop takes a Reload (loop.applyPolicy).
	spec    config.Driver
	log     *slog.Logger
	w       *fswatch.Watcher
	probe   func(context.Context, config.Driver) error
	cleanup bool // remove the socket on shutdown too
	// guard, if set, must pass before a socket is published: the process still holds the
	// registration directory.
	guard func() error
	// slots bound the calls to endpoints in flight across the supervisor's loops.
	slots probe.Slots
	// hub serves the loop's sockets, with the supervisor's other loops'.
	hub *regserver.Hub
	// moves is what the supervisor's loops know of how kubelet takes a device plugin's move
	// to a new endpoint, with kubelet's view of device-plugin resources (devicemoves.go).
	moves *deviceMoves

	verdictC chan struct{} // capacity 1: a verdict is pending

	// Only the loop's goroutine uses these.
	// at is the endpoint registered, or to register (pattern.go); zero for a pattern not yet
	// matched.
	at target
	// nodeInfo is what a CSI driver answered NodeGetInfo once kubelet registered the current
	// socket (restart.go); nil when not asked or not answered.
	nodeInfo *csi.NodeGetInfoResponse
	// health are the DRAResourceHealth services the driver's endpoint serves, advertised after
	// its versions (health.go); nil when none, or not asked.
	health []string
	// healthKnown: health is what the driver answered, an instance of it asked earlier by this
	// loop, or what a hand-over told of; a silent endpoint keeps it (health.go).
	healthKnown bool
	// healthOf is the endpoint socket health was asked of (or a hand-over told of).
	healthOf fsid.ID
	// ro is the endpoint's rollover to a new instance under way, if any (rollover.go).
	ro *rollover
	// verify is a device plugin's move being checked in kubelet's view (devicemoves.go).
	verify *verification
	// withdrawnAt is when the loop last removed, or lost, a socket kubelet may hold from each
	// registration path: kubelet may hold it until its next reconcile pass (freePath,
	// clearPath). Kept by drivers with several paths, and by DRA drivers; nil until then.
	withdrawnAt map[string]time.Time
	// p paces registration attempts.
	p *pacing
	// probed is the endpoint's socket as last probed ready; zero when it was not there.
	probed fsid.ID
	// adopted is what a hand-over gave the loop to start from (inherit.go); the loop takes it
	// when it starts. handed is what the loop hands over when it stops for one (detach).
	adopted *adoption
	handed  *handover.Driver

	// guards: gen, lastGen, pending, policy, st. The fields above it are the loop goroutine's,
	// or set by newDriver and the supervisor before the loop starts.
	mu      sync.Mutex
	gen     uint64             // the current socket generation; verdicts for others are dropped
	lastGen uint64             // the newest generation numbered: each socket gets its own number
	pending *regserver.Verdict // the latest verdict for gen
	policy  *config.Driver     // a loop policy not yet taken by the loop (updatePolicy)
	st      DriverStatus
}

func newDriver(spec config.Driver, log *slog.Logger, w *fswatch.Watcher, cleanup bool) *driver {
	d := &driver{
		spec:     spec,
		log:      log.With("driver", spec.Name),
		w:        w,
		probe:    probe.Endpoint,
		cleanup:  cleanup,
		verdictC: make(chan struct{}, 1),
		p:        newPacing(spec),
	}
	if !spec.EndpointIsPattern() {
		d.at = fixedTarget(spec)
	}
	d.st = DriverStatus{
		Name:        spec.Name,
		Type:        spec.Type,
		Phase:       WaitingForEndpoint,
		Socket:      spec.SocketPath,
		Endpoint:    spec.Endpoint,
		Required:    spec.Required,
		Since:       time.Now(),
		Results:     map[string]int{},
		Recreations: map[string]int{},
	}
	if !spec.WaitForEndpoint {
		d.st.Phase = Serving
	}
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

// updatePolicy gives the loop spec's loop policy: spec registers as the loop does
// (config.Driver.SameRegistration holds), so nothing is published and kubelet sees nothing.
// Required is in the status at once; the loop takes the rest at its next step (the Reload
// event). It never blocks.
func (d *driver) updatePolicy(spec config.Driver) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.st.Required = spec.Required
	d.policy = &spec
}

// takePolicy takes the loop policy updatePolicy gave, if any.
func (d *driver) takePolicy() *config.Driver {
	d.mu.Lock()
	defer d.mu.Unlock()
	spec := d.policy
	d.policy = nil
	return spec
}
