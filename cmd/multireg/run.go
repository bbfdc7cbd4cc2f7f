package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

// runDaemon is `multireg run`: it registers every configured driver until SIGTERM or SIGINT.
func runDaemon(ctx context.Context, args []string, stderr io.Writer) error {
	// From the first instant: a signal's default action would kill the process, also while
	// it reads the file or waits for another instance. A SIGHUP before the reloader runs is
	// not lost: the reloader reads the file when it starts watching it.
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	fs := newFlagSet("run", stderr)
	path := fs.String("config", "", "path to the drivers file (required)")
	logFormat := fs.String("log-format", "text", "log format: text or json")
	verbosity := fs.Int("v", 0, "log verbosity: 0 logs phase changes and failures, 1 or more adds every kubelet call")
	cleanup := fs.Bool("cleanup-on-exit", false, "remove every registration socket on exit, so kubelet deregisters every plugin (uninstall)")
	httpAddr := fs.String("http-endpoint", defaultHTTPEndpoint, "serve /healthz, /readyz, /status and /metrics on this address; empty disables")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return usagef("multireg run: --config is required")
	}
	if err := checkListenAddr(*httpAddr); err != nil {
		return usagef("multireg run: --http-endpoint %q: %v", *httpAddr, err)
	}
	log, err := newLogger(stderr, *logFormat, *verbosity)
	if err != nil {
		return err
	}

	// Set once for the whole process (never around each listen: loops run concurrently), so
	// that no socket or file is ever created with wider permissions than owner-only.
	syscall.Umask(0o077)

	cfg, content, err := config.LoadContent(*path)
	if err != nil {
		return err
	}

	lock, err := registrar.AcquireLock(ctx, cfg.RegistrationDir, log)
	if errors.Is(err, context.Canceled) {
		return nil // stopped while waiting for another instance
	}
	if err != nil {
		return err
	}
	if ctx.Err() != nil { // stopped while the lock was taken: start nothing
		lock.Release()
		return nil
	}
	var lockMu sync.Mutex // the reloader moves the lock when registrationDir changes
	defer func() {
		lockMu.Lock()
		defer lockMu.Unlock()
		lock.Release()
	}()

	// Sockets of drivers removed from the file while no multireg ran: nothing else would
	// ever remove them, and kubelet would keep those plugins.
	if _, err := registrar.RemoveOrphans(cfg.RegistrationDir, socketNames(cfg), log); err != nil {
		log.Warn("look for sockets of drivers no longer configured", "err", err)
	}

	// Nothing is written in the directory unless this process still holds it.
	guard := func() error {
		lockMu.Lock()
		defer lockMu.Unlock()
		return lock.Refresh()
	}
	owned := &ownedRecord{log: log, guard: guard}
	sup, err := registrar.New(registrar.Options{Log: log, CleanupOnExit: *cleanup, Guard: guard})
	if err != nil {
		return fmt.Errorf("start: %w", err)
	}
	rl := reload.New(reload.Options{
		Path:           *path,
		Initial:        cfg,
		InitialContent: content,
		Apply:          sup,
		Log:            log,
		Applied:        owned.record,
		MoveDir: func(dir string) (func(), error) {
			lockMu.Lock()
			same := sameDir(dir, lock.Dir())
			lockMu.Unlock()
			if same {
				// Another name of the directory this process holds: check the lock under it.
				return func() {
					lockMu.Lock()
					defer lockMu.Unlock()
					lock.Rename(dir)
				}, nil
			}
			next, err := registrar.TryLock(dir, log)
			if err != nil {
				return nil, err
			}
			return func() {
				lockMu.Lock()
				defer lockMu.Unlock()
				lock.Release()
				lock = next
			}, nil
		},
	})

	// The supervisor outlives everything that changes its drivers: it stops only after the
	// reloader has stopped. When the directory is lost, it stops with that cause and leaves
	// every socket to the instance that took it.
	state := &daemonState{drivers: sup.Status, config: rl.State}
	supCtx, stopSup := context.WithCancelCause(context.Background())
	supDone := make(chan error, 1)
	state.loops.Add(1)
	go func() {
		defer state.loops.Add(-1)
		supDone <- sup.Run(supCtx)
	}()
	defer stopSup(nil)

	// The HTTP server answers until everything else has stopped.
	httpCtx, stopHTTP := context.WithCancel(context.Background())
	defer stopHTTP()
	waitHTTP := func() error { return nil }
	if *httpAddr != "" {
		waitHTTP, err = serveHTTP(httpCtx, *httpAddr, newHandler(state, newRegistry(sup, rl)), log)
		if err != nil {
			stopSup(nil)
			<-supDone
			return err
		}
	}

	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)
	var wg sync.WaitGroup
	var rlErr error
	state.loops.Add(1)
	wg.Go(func() {
		defer state.loops.Add(-1)
		rlErr = rl.Run(ctx)
	})
	wg.Go(func() {
		check := time.NewTicker(registrar.LockCheck)
		defer check.Stop()
		lockErr := "" // the last failure to check the lock, logged once
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				log.Info("SIGHUP: re-reading the config")
				rl.Kick()
			case <-check.C:
				lockMu.Lock()
				err := lock.Refresh()
				lockMu.Unlock()
				switch {
				case errors.Is(err, registrar.ErrDirLost):
					log.Error("stopping without touching the sockets: another instance serves this directory now", "err", err)
					fail(err)
					return
				case err != nil:
					// Nobody else can hold a lock file that cannot be made: the old one stays
					// held, and every publish waits for the check to pass (the guard).
					if msg := err.Error(); msg != lockErr {
						lockErr = msg
						log.Warn("cannot check the registration directory's lock; retrying every second", "err", err)
					}
					continue
				}
				lockErr = ""
				owned.retry()
			}
		}
	})
	log.Info("multireg started", "version", version, "config", *path, "drivers", cfg.Summary())

	<-ctx.Done()
	wg.Wait()
	var lost error
	if cause := context.Cause(ctx); !errors.Is(cause, context.Canceled) {
		lost = cause
	}
	stopSup(lost)
	supErr := <-supDone
	stopHTTP()
	httpErr := waitHTTP()
	log.Info("multireg stopped", "cleanup", *cleanup && lost == nil)
	return errors.Join(lost, rlErr, supErr, httpErr)
}

// ownedRecord writes the record of the sockets multireg owns (registrar.RecordOwned) for each
// applied configuration, and retries a write that failed (a read-only or vanished directory)
// until it succeeds: without it, a driver removed while multireg does not run would keep its
// socket forever.
type ownedRecord struct {
	log   *slog.Logger
	guard func() error // passes while this process holds the directory

	mu      sync.Mutex
	pending *config.RegistrarConfig // a configuration whose record failed; nil when written
	lastErr string
}

func (o *ownedRecord) record(c *config.RegistrarConfig) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.pending = c
	o.write()
}

func (o *ownedRecord) retry() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.pending != nil {
		o.write()
	}
}

func (o *ownedRecord) write() {
	err := o.guard()
	if err == nil {
		err = registrar.RecordOwned(o.pending.RegistrationDir, socketNames(o.pending))
	}
	switch {
	case err == nil:
		if o.lastErr != "" {
			o.log.Info("recorded the sockets multireg owns", "dir", o.pending.RegistrationDir)
		}
		o.pending, o.lastErr = nil, ""
	case err.Error() != o.lastErr:
		o.lastErr = err.Error()
		o.log.Warn("the sockets of drivers removed while multireg does not run may stay; retrying", "err", err)
	}
}

// sameDir reports whether a and b name one existing directory.
func sameDir(a, b string) bool {
	fa, err := os.Stat(a)
	if err != nil {
		return false
	}
	fb, err := os.Stat(b)
	return err == nil && os.SameFile(fa, fb)
}

// checkListenAddr checks an --http-endpoint value before anything else runs: host:port with
// a port number or service name; empty disables the server.
func checkListenAddr(addr string) error {
	if addr == "" {
		return nil
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return err
	}
	return nil
}

// socketNames returns the socket file names of the configured drivers.
func socketNames(c *config.RegistrarConfig) []string {
	names := make([]string, len(c.Drivers))
	for i, d := range c.Drivers {
		names[i] = d.SocketName
	}
	return names
}

// newLogger returns the process logger: text or JSON on w, debug from verbosity 1.
func newLogger(w io.Writer, format string, verbosity int) (*slog.Logger, error) {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if verbosity > 0 {
		opts.Level = slog.LevelDebug
	}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, usagef("multireg run: --log-format %q: must be text or json", format)
}
