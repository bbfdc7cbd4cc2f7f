// Package reload keeps the running drivers in line with the drivers file: it watches the
// file's directory, debounces bursts of events, re-reads the file when it may have changed,
// and applies only the difference. A file that cannot be read or is invalid never stops what
// runs: the last good configuration stays in force.
package reload

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"multireg.dev/multireg/config"
)

// applier runs drivers. *registrar.Supervisor is one.
type applier interface {
	// Start starts a driver, or restarts it if one of that name runs. It cannot fail.
	Start(config.Driver)
	// Stop stops the named driver and removes its socket.
	Stop(name string)
	// Update gives a running driver what changed without needing a new registration.
	Update(config.Driver)
}

// Defaults for Options.
const (
	DefaultDebounce = 100 * time.Millisecond
	DefaultResync   = time.Minute
	// maxDebounce bounds how long a steady stream of events can hold a reload back.
	maxDebounce = time.Second
)

// Options configure a Reloader.
type Options struct {
	// Path is the drivers file.
	Path string
	// Initial is the configuration already loaded from Path; Run starts its drivers first.
	Initial *config.RegistrarConfig
	// InitialContent is the content Initial was parsed from, so that an unchanged file is
	// recognized.
	InitialContent []byte
	// Apply receives the drivers to stop and start.
	Apply applier
	// Log receives one line per applied change and per rejected file.
	Log *slog.Logger
	// MoveDir, if set, is called before a configuration that moves the registration
	// directory is applied; an error rejects the configuration, which is then tried again at
	// every later read until it is applied or the file changes. On success, done is called
	// once the configuration is applied. multireg takes the new directory's lock here, and
	// releases the old one in done.
	MoveDir func(dir string) (done func(), err error)
	// Applied, if set, is called with every configuration once it is applied, the initial
	// one included. multireg records the sockets it owns here.
	Applied func(*config.RegistrarConfig)
	// Debounce is how long the file must be quiet before it is read (DefaultDebounce).
	Debounce time.Duration
	// Resync re-reads the file this often even without an event (DefaultResync).
	Resync time.Duration
	// NoWatch turns off the file watch (tests drive the reloader with Kick).
	NoWatch bool
}

// State is the outcome of the reloads so far, for status and metrics.
type State struct {
	Path string
	// Generation counts applied configurations; the initial one is 1.
	Generation int
	// LastReloadSuccessful is false while the file on disk is not the configuration in force.
	LastReloadSuccessful bool
	LastReloadError      string
	// LastReloadTime is when the file was last read and judged.
	LastReloadTime time.Time
	// LastSuccessTime is when a configuration was last applied.
	LastSuccessTime time.Time
}

// Reloader applies the drivers file to the running drivers.
type Reloader struct {
	opts  Options
	log   *slog.Logger
	kicks chan struct{} // capacity 1: a pending "look at the file"

	// Owned by Run's goroutine.
	applied *config.RegistrarConfig
	seen    string // the last content (or read error) judged, so that it is judged once
	refused string // why MoveDir refused the content seen, which is then judged again; or ""

	// guards: state.
	mu    sync.Mutex
	state State
}

// New returns a Reloader for the options; Run starts it.
func New(opts Options) *Reloader {
	if opts.Debounce == 0 {
		opts.Debounce = DefaultDebounce
	}
	if opts.Resync == 0 {
		opts.Resync = DefaultResync
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Reloader{opts: opts, log: log, kicks: make(chan struct{}, 1)}
}

// Kick asks for the file to be read now (after the debounce). It never blocks; main wires
// SIGHUP to it.
func (r *Reloader) Kick() {
	select {
	case r.kicks <- struct{}{}:
	default:
	}
}

// State returns the outcome of the reloads so far.
func (r *Reloader) State() State {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state
}

// Run starts the initial configuration's drivers, then follows the file until ctx ends. It
// returns only after its watcher has stopped. It does not stop the drivers: their owner does.
func (r *Reloader) Run(ctx context.Context) error {
	r.applied = r.opts.Initial
	r.seen = contentKey(r.opts.InitialContent, nil)
	r.apply(config.Diff(nil, r.applied))
	r.notifyApplied()
	now := time.Now()
	r.setState(func(s *State) {
		*s = State{Path: r.opts.Path, Generation: 1, LastReloadSuccessful: true, LastReloadTime: now, LastSuccessTime: now}
	})

	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	follow := func() {}
	if !r.opts.NoWatch {
		w, err := newDirWatcher(r.opts.Path, r.log)
		if err != nil {
			return fmt.Errorf("watch config: %w", err)
		}
		follow = w.follow
		wg.Go(func() { w.run(ctx, r.Kick) })
	}
	resync := time.NewTicker(r.opts.Resync)
	defer resync.Stop()

	var debounce <-chan time.Time
	var timer *time.Timer
	var first time.Time // when the pending burst began
	for {
		select {
		case <-ctx.Done():
			if timer != nil {
				timer.Stop()
			}
			return nil
		case <-resync.C:
			r.Kick()
		case <-r.kicks:
			// Wait for the burst to end, but never longer than maxDebounce after it began.
			now := time.Now()
			if timer == nil {
				first = now
				timer = time.NewTimer(r.opts.Debounce)
			} else if now.Sub(first)+r.opts.Debounce <= maxDebounce {
				timer.Reset(r.opts.Debounce)
			}
			debounce = timer.C
		case <-debounce:
			timer, debounce = nil, nil
			follow() // a symlinked config may lead to another directory now
			r.reload()
		}
	}
}

// reload reads the file and, when it is new and valid, applies it.
func (r *Reloader) reload() {
	b, err := config.ReadFile(r.opts.Path)
	key := contentKey(b, err)
	now := time.Now()
	retried := ""
	if key == r.seen {
		if r.refused == "" {
			r.setState(func(s *State) { s.LastReloadTime = now })
			return // unchanged: kubelet touches mounted ConfigMaps every minute
		}
		retried = r.refused // not applied yet: try again
	}
	r.seen, r.refused = key, ""

	var cfg *config.RegistrarConfig
	if err == nil {
		cfg, err = config.ParseLocal(b)
	}
	moved := func() {}
	if err == nil && cfg.RegistrationDir != r.applied.RegistrationDir && r.opts.MoveDir != nil {
		done, derr := r.opts.MoveDir(cfg.RegistrationDir)
		if derr != nil {
			err = fmt.Errorf("registrationDir %s: %w", cfg.RegistrationDir, derr)
			r.refused = err.Error()
		} else {
			moved = done
		}
	}
	if err != nil {
		say := r.log.Warn
		if err.Error() == retried {
			say = r.log.Debug // said already
		}
		say("config not applied; the last good one stays in force", "config", r.opts.Path, "err", err)
		r.setState(func(s *State) {
			s.LastReloadSuccessful = false
			s.LastReloadError = err.Error()
			s.LastReloadTime = now
		})
		return
	}

	plan := config.Diff(r.applied, cfg)
	r.apply(plan)
	r.applied = cfg
	moved()
	r.notifyApplied()
	r.setState(func(s *State) {
		s.Generation++
		s.LastReloadSuccessful = true
		s.LastReloadError = ""
		s.LastReloadTime = now
		s.LastSuccessTime = now
	})
	if plan.Empty() {
		r.log.Info("config reloaded; no driver changed", "config", r.opts.Path)
		return
	}
	r.log.Info("config reloaded", "config", r.opts.Path,
		"added", names(plan.Added), "removed", names(plan.Removed), "changed", names(plan.Changed), "updated", names(plan.Updated))
}

// apply stops every removed and changed driver before it starts the added and changed ones,
// so that a socket path can move from one name to another in one edit.
func (r *Reloader) apply(p config.Plan) {
	for _, d := range p.Removed {
		r.opts.Apply.Stop(d.Name)
	}
	for _, d := range p.Changed {
		r.opts.Apply.Stop(d.Name)
	}
	for _, d := range p.Added {
		r.opts.Apply.Start(d)
	}
	for _, d := range p.Changed {
		r.opts.Apply.Start(d)
	}
	for _, d := range p.Updated {
		r.opts.Apply.Update(d)
	}
}

func (r *Reloader) notifyApplied() {
	if r.opts.Applied != nil {
		r.opts.Applied(r.applied)
	}
}

func (r *Reloader) setState(f func(*State)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.state)
}

// contentKey identifies what a read produced: the content's hash, or the error.
func contentKey(b []byte, err error) string {
	if err != nil {
		return "error: " + err.Error()
	}
	return fmt.Sprintf("sha256:%x", sha256.Sum256(b))
}

func names(ds []config.Driver) []string {
	n := make([]string, len(ds))
	for i, d := range ds {
		n[i] = d.Name
	}
	return n
}
