package registrar

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fswatch"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/regserver"
)

// Options configure a Supervisor.
type Options struct {
	// Log receives every loop's log lines, each with the driver's name.
	Log *slog.Logger
	// CleanupOnExit removes every registration socket when the supervisor stops, so that
	// kubelet deregisters every plugin (uninstall). By default sockets stay: a restarted
	// multireg renames fresh sockets over them, and kubelet keeps the plugins meanwhile.
	CleanupOnExit bool
	// Guard, if set, is called before every socket is published; an error stops the publish
	// (the attempt fails and backs off). multireg checks there that it still holds the
	// registration directory, so that an instance that lost it never publishes over the
	// sockets of the one that took it.
	Guard func() error
	// PodResources, if not nil, is kubelet's pod-resources view: Run keeps it read, status
	// shows each device plugin's resource as kubelet holds it, and a device plugin's move is
	// verified there (DeviceMoves).
	PodResources *podres.View
	// DeviceMoves is how a device plugin's new instance is registered ("": config.MovesAuto).
	DeviceMoves config.DeviceMoves
}

// A Supervisor is the holder of a hand-over (internal/handover): HandOver, Resume, Release.
var _ handover.Holder = (*Supervisor)(nil)

// Supervisor runs one registration loop per driver and shares one file watcher among them.
//
// Who owns what: each loop owns its driver's sockets and state (driver). The supervisor's own
// state — which loops run, whether a hand-over holds them, whether Run has ended them — is
// guarded by mu, and changed only by its methods, each on its caller's goroutine: Start, Stop
// and Update from the reloader, HandOver, Resume and Release from a hand-over, Status from HTTP.
// mu is never held across calls, nor while a loop stops. What outlasts one call is state
// under mu, and the calls that must wait for it wait on cond:
//   - a hand-over's pause is paused, set by HandOver and cleared by Resume or Release. Start,
//     Stop and Update arriving meanwhile wait until it is cleared (or Run has ended), and
//     HandOver waits until those already in progress (ops) have returned, so that no reload
//     changes the drivers while they are handed over;
//   - the end: ctx ends when Run stops the loops or Release gives them away, under mu, and
//     every loop is counted in wg under mu after a look at ctx: a loop either starts before
//     the end, and Run waits for it, or never starts.
//
// A goroutine owning the loops and serving these calls as commands was the alternative. Start
// and Stop each wait for a loop to exit (as long as its server takes to answer the calls
// begun), which that goroutine would either wait for in turn, stalling every other command,
// or track for each caller; it would need a life of its own beside Run's, and Status a way
// in. A monitor keeps each wait on its caller's goroutine, and adds no goroutine.
type Supervisor struct {
	log *slog.Logger
	// env is what the loops share (the watcher, the hub, the bound on endpoint calls in flight, what they know of
	// kubelet's device manager); tests may replace its probe before any loop starts.
	env *env

	ctx    context.Context // parent of every loop; ends, under mu, when Run returns or Release
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup // every loop; added to under mu, before ctx ends

	// guards: running, untaken, unfit, paused, ops, and ctx's end (cancel is called
	// holding it).
	mu sync.Mutex
	// cond is signalled, with mu, when paused is cleared, ops falls to 0 or ctx ends.
	cond    sync.Cond
	running map[string]*handle
	// untaken: what a hand-over brought that no loop has taken over yet, for Start to take
	// driver by driver.
	untaken *handover.Snapshot
	// unfit: the drivers' sockets did not fit in the descriptor budget at the last look
	// (checkDescriptors).
	unfit bool
	// paused: a hand-over stopped the loops (HandOver) and has not ended (Resume, Release).
	paused bool
	// ops counts the Start, Stop and Update calls past their wait for paused.
	ops int

	// takenOver counts the handed-over sockets the loops serve.
	takenOver atomic.Int64
}

// handle is one running loop.
type handle struct {
	d *driver
	// spec is the driver as the supervisor was last given it (Start, Update): what the next
	// Update compares with. The loop's own copy is the loop's.
	spec   config.Driver
	cancel context.CancelCauseFunc
	done   chan struct{}
	// handed is what the loop handed over when it ended for a hand-over; set before done is
	// closed.
	handed *handover.Driver
}

// New returns a Supervisor with no drivers; it fails when the process cannot have one more
// inotify instance. Start adds drivers; Run must be called for their sockets to be watched,
// and to stop them and release the inotify instance.
func New(opts Options) (*Supervisor, error) {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	h, err := regserver.NewHub(log)
	if err != nil {
		return nil, err
	}
	w, err := fswatch.New(log)
	if err != nil {
		h.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	moves := &deviceMoves{mode: cmp.Or(opts.DeviceMoves, config.MovesAuto), view: opts.PodResources, log: log}
	e := &env{w: w, hub: h, inFlight: make(probe.InFlight, probe.MaxInFlight), healthWaits: make(probe.InFlight, probe.MaxHealthWaits),
		moves: moves, guard: opts.Guard, probe: probe.Endpoint, cleanup: opts.CleanupOnExit, changes: &changes{}}
	s := &Supervisor{log: log, env: e, ctx: ctx, cancel: cancel, running: map[string]*handle{}}
	s.cond.L = &s.mu
	return s, nil
}

// enter waits while a hand-over holds the loops (paused), then counts a Start, Stop or
// Update in progress, which leave must end. After the end it waits for nothing: the call
// finds no loop, and starts none.
func (s *Supervisor) enter() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.paused && s.ctx.Err() == nil {
		s.cond.Wait()
	}
	s.ops++
}

func (s *Supervisor) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ops--
	if s.ops == 0 {
		s.cond.Broadcast()
	}
}

// end ends every loop with cause (their context's): Run's shutdown, or Release. mu is held.
func (s *Supervisor) end(cause error) {
	s.cancel(cause)
	s.cond.Broadcast()
}

// Start starts the loop of d, or restarts it when a driver of that name runs (the old loop is
// stopped first, and its socket removed). It cannot fail: the loop owns its failures. After
// Run has returned it does nothing.
//
// When a hand-over brought the driver (TakeOver) and d registers it the same way, the loop
// serves the sockets handed over and goes on where the other instance's stood: kubelet sees
// nothing. When d registers it differently, the handed sockets are removed first, as a reload
// would remove them.
func (s *Supervisor) Start(d config.Driver) {
	s.enter()
	defer s.leave()
	s.start(d, nil, true)
}

// start is Start, with what a hand-over gave the driver (hd), if anything: otherwise what
// TakeOver left for it. counted: the sockets taken from hd are counted as a hand-over's
// (TakenOver); a loop moved in this process (move) takes its own.
func (s *Supervisor) start(d config.Driver, hd *handover.Driver, counted bool) {
	s.mu.Lock()
	if hd == nil {
		hd = s.untaken.Take(d.Name)
	}
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		if hd != nil {
			s.endUntaken(hd, !counted)
		}
		return
	}
	old := s.running[d.Name]
	ctx, cancel := context.WithCancelCause(s.ctx)
	h := &handle{d: newDriver(d, s.log, s.env.changes), spec: d, cancel: cancel, done: make(chan struct{})}
	s.running[d.Name] = h
	s.wg.Add(1) // before ctx can end: Run's Wait counts this loop
	s.mu.Unlock()
	s.checkDescriptors()
	var a *takeover
	switch {
	case hd == nil:
	case hd.RegistersAs(d):
		var n int
		if a, n = h.d.takeOver(hd, &sockets{d: h.d, env: s.env}); counted {
			s.takenOver.Add(int64(n))
		}
	default:
		h.d.log.Info("the driver registers differently than in the instance that handed it over; registering anew")
		hd.Withdraw(h.d.log)
	}
	// The new loop starts only once the old one is gone, so they never share the socket.
	go func() {
		defer s.wg.Done()
		defer close(h.done)
		if old != nil {
			old.cancel(errRemoved)
			<-old.done
		}
		h.handed = h.d.run(ctx, s.env, a)
	}()
	if old != nil {
		<-old.done
	}
}

// Update gives the running loop of d's name what changed in d besides its registration
// (config.Driver: Registration is the same), and kubelet sees nothing: a new Policy (and
// Display) the loop takes at its next step; a new Local moves the loop there, its sockets
// kept as a hand-over keeps them (move). It is a no-op for unknown names.
func (s *Supervisor) Update(d config.Driver) {
	s.enter()
	defer s.leave()
	s.mu.Lock()
	h, ok := s.running[d.Name]
	var was config.Driver
	if ok {
		was, h.spec = h.spec, d
	}
	s.mu.Unlock()
	switch {
	case !ok:
	case was.Changes(d)&config.ChangeLocal != 0:
		s.move(h, was, d)
	default:
		h.d.updatePolicy(d)
	}
}

// move restarts h's loop, configured as was, as d, which differs from it in where this
// process reaches the endpoint (config.Local), the way a hand-over restarts it in another
// process: the loop stops and hands over its sockets and state, and the new one serves them
// and goes on, its endpoint probed where d says. kubelet sees nothing.
func (s *Supervisor) move(h *handle, was, d config.Driver) {
	h.cancel(errHandOver)
	<-h.done
	hd := h.handed
	h.handed = nil
	s.mu.Lock()
	current := s.running[d.Name] == h
	s.mu.Unlock()
	if !current { // stopped or started anew meanwhile: what it handed over is no one's now
		if hd != nil {
			hd.Withdraw(h.d.log)
		}
		return
	}
	h.d.log.Info("where this process reaches the driver's endpoint changed; the loop goes on there with its sockets",
		"localEndpoint", d.LocalEndpoint)
	if was.Policy != d.Policy {
		h.d.log.Info("loop policy updated; the registration stays", "backoff", d.Backoff, "registrationTimeout", d.RegistrationTimeout,
			"waitForEndpoint", d.WaitForEndpoint, "required", d.Required)
	}
	s.start(d, hd, false)
}

// endUntaken ends what a hand-over left that no loop takes over because the supervisor has
// ended: closed, or, when it is the supervisor's own (own: a loop of this process handed it
// over, to move or to be resumed) and the supervisor shut down with cleanup asked for,
// withdrawn, as its loop would have withdrawn it.
func (s *Supervisor) endUntaken(hd *handover.Driver, own bool) {
	if own && s.env.cleanup && errors.Is(context.Cause(s.ctx), errShutdown) {
		hd.Withdraw(s.log.With("driver", hd.Spec.Name))
		return
	}
	hd.Close()
}

// Stop stops the named driver, removes its socket (kubelet deregisters the plugin) and
// blocks until the loop has exited. It is a no-op for unknown names.
func (s *Supervisor) Stop(name string) {
	s.enter()
	defer s.leave()
	s.mu.Lock()
	h, ok := s.running[name]
	delete(s.running, name)
	s.mu.Unlock()
	if !ok {
		return
	}
	h.cancel(errRemoved)
	<-h.done
	s.env.changes.notify()
	s.checkDescriptors()
}

// Run blocks until ctx ends, then stops every loop and waits for all of them. Sockets stay
// in place unless CleanupOnExit was set. When ctx ends with a cause that is ErrDirLost, the
// sockets are another instance's now: they stay whatever CleanupOnExit says.
func (s *Supervisor) Run(ctx context.Context) error {
	// The watcher outlives the loops: they unsubscribe as they stop.
	wctx, stopWatcher := context.WithCancel(context.Background())
	watcherDone := make(chan struct{})
	go func() {
		defer close(watcherDone)
		s.env.w.Run(wctx)
	}()
	// kubelet's view is read while the loops run, and stops with them.
	vctx, stopView := context.WithCancel(context.Background())
	viewDone := make(chan struct{})
	go func() {
		defer close(viewDone)
		if s.env.moves.view != nil {
			s.env.moves.view.Run(vctx)
		}
	}()
	warnDone := make(chan struct{})
	go func() {
		defer close(warnDone)
		s.watchKubelet(vctx)
	}()
	<-ctx.Done()
	cause := errShutdown
	if c := context.Cause(ctx); errors.Is(c, regdir.ErrDirLost) {
		cause = c
	}
	s.mu.Lock()
	s.end(cause)
	s.running = map[string]*handle{}
	s.mu.Unlock()
	s.wg.Wait() // no loop is added from now on: ctx has ended
	stopView()
	<-viewDone
	<-warnDone
	s.env.hub.Close()
	stopWatcher()
	<-watcherDone
	return nil
}

// TakeOver gives the supervisor what a hand-over brought (regdir.Open), before any driver starts:
// Start takes each driver's part. The supervisor owns snap from now on.
func (s *Supervisor) TakeOver(snap *handover.Snapshot) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.untaken.Close()
	s.untaken = snap
}

// TakenOver is the number of handed-over sockets the loops took over (TakeOver).
func (s *Supervisor) TakenOver() int {
	return int(s.takenOver.Load())
}

// DropUntaken removes the handed-over sockets no driver took, once the configuration is
// applied: their drivers are no longer configured, and a reload would have removed them.
func (s *Supervisor) DropUntaken() {
	s.mu.Lock()
	snap := s.untaken
	s.untaken = nil
	done := s.ctx.Err() != nil
	s.mu.Unlock()
	if snap == nil {
		return
	}
	if done { // handed over or stopped: the sockets are not this supervisor's to remove
		snap.Close()
		return
	}
	snap.Withdraw(s.log) // a line for each driver when few, one for all when many
}

// HandOver stops every loop for a hand-over and returns what they hand over (loop.handOverState):
// the sockets stay, listening. It waits for the Start, Stop and Update calls in progress, and
// those that come later wait until Resume or Release.
func (s *Supervisor) HandOver() *handover.Snapshot {
	s.mu.Lock()
	for s.paused && s.ctx.Err() == nil { // another hand-over's pause: one at a time
		s.cond.Wait()
	}
	s.paused = true
	for s.ops > 0 {
		s.cond.Wait()
	}
	hs := s.running
	s.running = map[string]*handle{}
	s.mu.Unlock()
	for _, h := range hs {
		h.cancel(errHandOver)
	}
	snap := &handover.Snapshot{}
	for _, h := range hs {
		<-h.done
		if h.handed != nil {
			snap.Add(h.handed)
			h.handed = nil
		}
	}
	return snap
}

// Resume runs the loops again from what HandOver returned, after a hand-over that failed, and
// then lets the Start, Stop and Update calls waiting on HandOver go on. It takes snap's
// descriptors.
func (s *Supervisor) Resume(snap *handover.Snapshot) {
	for _, h := range snap.TakeAll() {
		s.start(h.Spec, h, false)
	}
	s.takenOver.Store(0) // the loops serve their own sockets again
	s.mu.Lock()
	s.paused = false
	s.cond.Broadcast()
	s.mu.Unlock()
}

// Release ends a hand-over that succeeded: the supervisor runs no loop again (Start does
// nothing), and the calls waiting on HandOver return. It serves no listener: the listeners
// the new instance took are multireg's endpoints'.
func (s *Supervisor) Release([]handover.ListenerSpec) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = false
	s.end(errHandOver)
}

// Status returns a snapshot of every driver, sorted by name.
func (s *Supervisor) Status() []DriverStatus {
	s.mu.Lock()
	hs := make([]*handle, 0, len(s.running))
	for _, h := range s.running {
		hs = append(hs, h)
	}
	s.mu.Unlock()
	st := make([]DriverStatus, 0, len(hs))
	r, up := s.env.moves.view.Last()
	for _, h := range hs {
		ds := h.d.status()
		if up && ds.Type == config.DevicePlugin {
			ds.Kubelet = kubeletView(r, ds)
		}
		st = append(st, ds)
	}
	slices.SortFunc(st, func(a, b DriverStatus) int { return strings.Compare(a.Name, b.Name) })
	return st
}

// Target says, for a liveness check of the named driver, its type, its endpoint's socket as
// this process reaches it ("" while a pattern has no match yet) and its health timeout; false
// for a name that is not running.
func (s *Supervisor) Target(name string) (typ, local string, timeout time.Duration, ok bool) {
	s.mu.Lock()
	h, ok := s.running[name]
	var spec config.Driver
	if ok {
		spec = h.spec
	}
	s.mu.Unlock()
	if !ok {
		return "", "", 0, false
	}
	h.d.mu.Lock()
	local = h.d.local
	h.d.mu.Unlock()
	return spec.Type, local, spec.HealthTimeout, true
}
