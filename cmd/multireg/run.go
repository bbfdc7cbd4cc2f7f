//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/health"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/podres"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/nodecond"
	"multireg.dev/multireg/nodecond/relay"
	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

// runDaemon is `multireg run`: it registers every configured driver until SIGTERM or SIGINT.
func runDaemon(ctx context.Context, args []string, std stdio, helpOnly bool) error {
	stdout, stderr := std.out, std.err
	// From the first instant: a signal's default action would kill the process, also while
	// it reads the file or waits for another instance. A SIGHUP before the reloader runs is
	// not lost: the reloader reads the file when it starts watching it.
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	f, err := parseRunFlags(args, stdout, helpOnly)
	if err != nil {
		return err
	}
	log := newLogger(stderr, f)

	// Set once for the whole process (never around each listen: loops run concurrently), so
	// that no socket or file is ever created with wider permissions than owner-only.
	syscall.Umask(0o077)

	cfg, content, err := config.LoadContent(f.path)
	if err != nil {
		return err
	}
	// The node condition's agent, the one process that speaks to the Kubernetes API: started
	// before anything else, so that one that cannot start stops the start (its kubeconfig
	// unreadable, no service account in a pod).
	var cond *relay.Relay
	if f.nodeCondition != "" {
		agent := f.agent
		if agent == "" {
			if agent, err = relay.AgentPath(); err != nil {
				return fmt.Errorf("--node-condition %s: %w", f.nodeCondition, err)
			}
		}
		cond = relay.New(relay.Options{
			Agent: agent, Type: f.nodeCondition, Stderr: stderr, Log: log,
			Args: nodecond.AgentArgs(f.nodeCondition, f.nodeName, f.kubeconfig, f.taint, f.logFormat, strings.ToLower(f.level.String())),
		})
		if err := cond.Start(); err != nil {
			return fmt.Errorf("--node-condition %s: %w", f.nodeCondition, err)
		}
		defer cond.Stop(context.Background(), false)
	}
	in := newInstance()
	// The drivers' liveness checks, answered whatever the process's role, on --http-endpoint
	// and the health endpoints: a check asks the driver, never the loops.
	targets := &healthTargets{cfg: cfg}
	checker := health.New(targets.get, log)
	defer checker.Close()
	in.always(checker.Collector())
	// The HTTP server answers whatever the process's role, from before it takes the
	// directory until everything else has stopped. Its failure stops the process (runCtx).
	// The health endpoints are bound once this instance serves the directory or stands by,
	// or taken from the previous instance in a hand-over, as --http-endpoint's may be
	// (endpoints).
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var httpErr error // the HTTP server's failure, once it stopped the process
	var httpOnce sync.Once
	fail := func(err error) {
		httpOnce.Do(func() { httpErr = err })
		stopRun()
	}
	eps := newEndpoints(f.httpAddr, newHandler(in, checker.Handler()), f.healthHTTP, f.healthGRPC, checker, fail, log)
	defer eps.stop()
	if err := eps.ensure(httpName); err != nil {
		return err
	}
	log.Info("multireg started", "version", version, "config", f.path, "drivers", cfg.Summary())
	procCgroup, _ := os.ReadFile("/proc/self/cgroup")
	switch limit, from, err := setMemoryLimit("/sys/fs/cgroup", procCgroup); {
	case err != nil:
		log.Warn("no memory limit for the Go runtime: the cgroup's cannot be read; set GOMEMLIMIT", "err", err)
	case limit > 0:
		log.Info("the Go runtime's memory limit", "bytes", limit, "from", from)
	default:
		log.Info("no memory limit for the Go runtime: the cgroup sets none (GOMEMLIMIT would give one)")
	}
	r := &rounds{f: f, log: log, in: in, cfg: cfg, content: content, signalled: ctx, cond: cond, targets: targets, eps: eps}
	err = r.run(runCtx, hup)
	eps.stop() // waits for every server: httpErr is set by then, if ever
	if err == nil && httpErr != nil {
		err = httpErr
	}
	log.Info("multireg stopped", "cleanup", f.cleanup && r.served && !errors.Is(err, regdir.ErrDirLost))
	return err
}

// rounds are a process's turns at serving the registration directory. The first takes it,
// asking its holder to hand it over; a round that hands it over leaves the process idle,
// waiting with the sockets it handed over in case its successor ends without a clean shutdown
// (roleIdle): if it gets the directory back, another round serves them.
type rounds struct {
	f       runFlags
	log     *slog.Logger
	in      *instance
	cfg     *config.RegistrarConfig
	content []byte
	served  bool // a round served the directory
	// signalled ends with SIGTERM or SIGINT (a clean stop), not with a failure.
	signalled context.Context
	// cond runs the node condition's agent; nil when the condition is off.
	cond *relay.Relay
	// targets are what the drivers' liveness checks dial; eps serves them and the HTTP
	// server, and takes the listeners a hand-over brings.
	targets *healthTargets
	eps     *endpoints
}

// run runs rounds until a signal or a failure of the HTTP server (ctx ends), or a fatal error.
func (r *rounds) run(ctx context.Context, hup <-chan os.Signal) error {
	ask := true
	var kept *handover.Snapshot // sockets this process handed over, kept while idle
	for {
		opts := regdir.Options{Ask: ask, Kept: kept, Listeners: r.eps.wanted()}
		if kept == nil {
			opts.Standby = func(why string) {
				r.in.set(roleStandby, why)
				r.log.Info("standing by: ready, and serving nothing until the directory is free", "why", why)
				// The drivers' checks, beside the instance that holds the directory.
				if err := r.eps.ensure(); err != nil {
					r.log.Warn("the drivers' health endpoints are not served while standing by", "err", err)
				}
			}
		}
		if ask {
			r.in.set(roleStarting, "taking the registration directory "+r.cfg.RegistrationDir)
		}
		dir, got, err := regdir.Open(ctx, r.cfg, r.log, opts)
		ask, kept = false, nil
		if errors.Is(err, context.Canceled) {
			return nil // stopped while waiting for another instance
		}
		if err != nil {
			return err
		}
		stopped, serr := takeStopped(dir.Path())
		if serr != nil {
			r.log.Warn("remove the mark of a clean stop", "err", serr)
		}
		if opts.Kept != nil && stopped {
			// The successor was stopped on purpose, not crashed: serve nothing either.
			got.Close()
			dir.Close()
			r.in.set(roleIdle, "the instance this one handed over to was stopped (not crashed): nothing to take back; exiting on SIGTERM")
			r.log.Info("the successor was stopped cleanly; not taking the directory back, staying idle until SIGTERM")
			<-ctx.Done()
			return nil
		}
		if opts.Kept != nil && got.Alive() == 0 {
			// The successor ended, and none of the sockets handed over is still at its path:
			// it removed them (an uninstall), or replaced them. Nothing to take back.
			got.Close()
			dir.Close()
			r.in.set(roleIdle, "the instance this one handed over to has ended, and its sockets are gone: nothing to take back")
			r.log.Info("the successor ended, and none of the sockets handed over is still at its path; staying idle until SIGTERM")
			<-ctx.Done()
			return nil
		}
		err = r.serve(ctx, hup, dir, got)
		if err == nil && r.signalled.Err() != nil && !r.f.cleanup {
			// A clean stop: an idle predecessor waiting for this one leaves the directory be.
			// (--cleanup-on-exit removed the sockets: nothing to take back, no mark to leave.)
			if merr := markStopped(dir.Path()); merr != nil {
				r.log.Warn("mark the clean stop in the registration directory", "err", merr)
			}
		}
		dir.Close()
		ho, handed := errors.AsType[*handover.HandedOver](err)
		if !handed {
			return err
		}
		kept = ho.Snapshot
		r.served = false // the sockets are the successor's: an exit from idle removes none
		r.in.set(roleIdle, fmt.Sprintf("handed %d drivers (%d sockets) over to a new instance in %s; serving nothing, exiting on SIGTERM",
			kept.Len(), kept.Sockets(), ho.Took.Round(time.Millisecond)))
		// Another round is taken only if the successor ends: read the file again by then.
		if cfg, content, err := config.LoadContent(r.f.path); err == nil {
			r.cfg, r.content = cfg, content
		}
	}
}

// serve runs one round: the daemon on the directory held, with the sockets a hand-over
// brought (got).
func (r *rounds) serve(ctx context.Context, hup <-chan os.Signal, dir *regdir.Dir, got *handover.Snapshot) error {
	log := r.log
	var view *podres.View
	sock := r.f.podResources
	if sock == autoPodResources {
		sock = podres.SocketPath(r.cfg.RegistrationDir)
	}
	if sock != "" {
		view = podres.New(sock, log)
	}
	sup, err := registrar.New(registrar.Options{Log: log, CleanupOnExit: r.f.cleanup, Guard: dir.Check, PodResources: view, DeviceMoves: r.f.moves})
	if err != nil {
		got.Close()
		return fmt.Errorf("start: %w", err)
	}
	handed := got.Sockets() // the loops take over those of their drivers; the others are withdrawn (DropUntaken)
	r.eps.adopt(got)        // the previous instance's listeners, served from now on
	if err := r.eps.ensure(); err != nil {
		got.Close()
		return err
	}
	sup.TakeOver(got)
	r.targets.set(r.cfg, sup)
	defer r.targets.set(nil, nil) // a round that ends serves no loop
	rl := reload.New(reload.Options{
		Path:           r.f.path,
		Initial:        r.cfg,
		InitialContent: r.content,
		Apply:          sup,
		Log:            log,
		MoveDir:        dir.Move,
		Applied: func(cfg *config.RegistrarConfig) {
			sup.DropUntaken() // sockets of drivers no longer configured
			dir.Record(cfg)
			r.targets.set(cfg, sup)
		},
	})
	d := &daemon{log: log, dir: dir, sup: sup, rl: rl, eps: r.eps, in: r.in}
	state := &daemonState{drivers: sup.Status, config: rl.State, takenOver: sup.TakenOver, descriptors: sup.Descriptors, podResources: sup.PodResources,
		liveness: r.eps.checker.Last}
	if r.cond != nil {
		d.cond = r.cond
		d.condSrc = relay.Source{Drivers: sup.Status, Changed: sup.Changed, PodResources: sup.PodResources, PodResourcesChanged: view.Changed}
		state.nodeCondition = d.cond.Status
	}
	detail := "holds the registration directory " + r.cfg.RegistrationDir
	if handed > 0 {
		detail = "took the registration directory " + r.cfg.RegistrationDir + " over from the previous instance"
	}
	r.in.serve(state, newRegistry(sup, rl, d.cond), detail)
	r.served = true
	fds := sup.Descriptors()
	log.Info("serving the registration directory", "dir", r.cfg.RegistrationDir, "drivers", r.cfg.Summary(), "socketsHandedOver", handed,
		"fdLimit", fds.Limit, "socketRoom", fds.MaxSockets)
	err = d.run(ctx, hup, state)
	if d.cond != nil {
		// This round is over: a hand-over's successor keeps the condition with its own agent,
		// and a round that takes the directory back starts another. At an uninstall every
		// registration is withdrawn: the condition would otherwise stay as last written.
		withdraw := err == nil && r.f.cleanup && r.signalled.Err() != nil
		wctx, cancel := context.WithTimeout(context.Background(), withdrawTimeout)
		if werr := d.cond.Stop(wctx, withdraw); werr != nil && withdraw {
			log.Warn("could not say on the Node that multireg stopped (the condition stays as last written)", "err", werr)
		}
		cancel()
	}
	return err
}

// withdrawTimeout bounds the last write of the node condition at an uninstall's exit (the
// agent's own bound is 3 s): well within a pod's grace period after the loops' own stop.
const withdrawTimeout = 4 * time.Second

// daemon is a multireg that holds its registration directory: its drivers, the reloader that
// changes them.
type daemon struct {
	log *slog.Logger
	dir *regdir.Dir
	sup *registrar.Supervisor
	rl  *reload.Reloader
	// cond runs the node condition's agent, fed from condSrc; nil when the condition is off.
	cond    *relay.Relay
	condSrc relay.Source
	// eps are the process's listeners: a hand-over gives them too.
	eps *endpoints
	in  *instance
}

// holder is the supervisor as a hand-over's holder, with the process's listeners: they go to
// the new instance with the sockets, and this one serves no more those the new one took.
// Meanwhile it is not ready: on the host's network, a probe of the new pod may reach it.
type holder struct {
	*registrar.Supervisor
	eps *endpoints
	in  *instance
}

func (h holder) HandOver() *handover.Snapshot {
	h.in.handingOver(true)
	snap := h.Supervisor.HandOver()
	h.eps.handOut(snap)
	return snap
}

func (h holder) Resume(snap *handover.Snapshot) {
	snap.DropListeners() // copies made for the new instance, which did not take them
	h.Supervisor.Resume(snap)
	h.in.handingOver(false)
}

func (h holder) Release(taken []handover.ListenerSpec) {
	h.Supervisor.Release(taken)
	h.eps.retire(taken, false) // the new instance serves them now; their sockets stay open there
}

// run runs the daemon's actors until a signal (ctx ends), a hand-over, or a fatal error stops
// them.
func (d *daemon) run(ctx context.Context, hup <-chan os.Signal, state *daemonState) error {
	log, dir, sup, rl := d.log, d.dir, d.sup, d.rl

	// Stopped in the reverse order: the signals first, then the reloader, so that nothing
	// changes the drivers while they stop; the lock check; the supervisor, which leaves every
	// socket to the instance that took the directory when the lock check stops with
	// ErrDirLost (after a hand-over, its loops have already handed their sockets over).
	var g group
	// The lock check's own result decides how the supervisor stops, whichever actor stopped
	// first: the directory may be lost while the others stop. The check has returned before
	// the supervisor is interrupted.
	var dirErr error
	supCtx, stopSup := context.WithCancelCause(context.Background())
	g.add(counted(&state.loops, func() error { return sup.Run(supCtx) }), func(error) {
		if errors.Is(dirErr, regdir.ErrDirLost) {
			stopSup(dirErr) // the sockets are another instance's: they stay
			return
		}
		stopSup(nil) // a shutdown: the sockets stay unless --cleanup-on-exit
	})
	dirCtx, stopDir := context.WithCancel(context.Background())
	g.add(func() error {
		dirErr = dir.Run(dirCtx, holder{Supervisor: sup, eps: d.eps, in: d.in})
		return dirErr
	}, func(error) { stopDir() })
	burstCtx, stopBurst := context.WithCancel(context.Background())
	g.add(func() error { return returnBurst(burstCtx, sup.Status, defaultBurstEnd(), log) }, func(error) { stopBurst() })
	rlCtx, stopRl := context.WithCancel(context.Background())
	g.add(counted(&state.loops, func() error { return rl.Run(rlCtx) }), func(error) { stopRl() })
	if d.cond != nil {
		condCtx, stopCond := context.WithCancel(context.Background())
		g.add(func() error { return d.cond.Run(condCtx, d.condSrc) }, func(error) { stopCond() })
	}
	sigCtx, stopSig := context.WithCancel(ctx)
	g.add(func() error {
		for {
			select {
			case <-sigCtx.Done():
				return nil
			case <-hup:
				log.Info("SIGHUP: re-reading the config")
				rl.Kick()
			}
		}
	}, func(error) { stopSig() })
	return g.run()
}

// counted counts execute in n from now until it returns.
func counted(n *atomic.Int32, execute func() error) func() error {
	n.Add(1)
	return func() error {
		defer n.Add(-1)
		return execute()
	}
}
