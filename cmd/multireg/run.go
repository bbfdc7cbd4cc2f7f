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
	"sync/atomic"
	"syscall"

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

	f, err := parseRunFlags(args, stderr)
	if err != nil {
		return err
	}
	log, err := newLogger(stderr, f.logFormat, f.verbosity)
	if err != nil {
		return err
	}

	// Set once for the whole process (never around each listen: loops run concurrently), so
	// that no socket or file is ever created with wider permissions than owner-only.
	syscall.Umask(0o077)

	cfg, content, err := config.LoadContent(f.path)
	if err != nil {
		return err
	}
	dir, err := registrar.OpenDir(ctx, cfg, log)
	if errors.Is(err, context.Canceled) {
		return nil // stopped while waiting for another instance
	}
	if err != nil {
		return err
	}
	defer dir.Close()

	var httpL net.Listener
	if f.httpAddr != "" {
		if httpL, err = listenHTTP(f.httpAddr); err != nil {
			return err
		}
	}
	sup, err := registrar.New(registrar.Options{Log: log, CleanupOnExit: f.cleanup, Guard: dir.Check})
	if err != nil {
		if httpL != nil {
			httpL.Close()
		}
		return fmt.Errorf("start: %w", err)
	}
	rl := reload.New(reload.Options{
		Path:           f.path,
		Initial:        cfg,
		InitialContent: content,
		Apply:          sup,
		Log:            log,
		MoveDir:        dir.Move,
		Applied:        dir.Record,
	})
	d := &daemon{log: log, dir: dir, sup: sup, rl: rl, httpL: httpL}
	log.Info("multireg started", "version", version, "config", f.path, "drivers", cfg.Summary())
	err = d.run(ctx, hup)
	log.Info("multireg stopped", "cleanup", f.cleanup && !errors.Is(err, registrar.ErrDirLost))
	return err
}

// daemon is a multireg that holds its registration directory: its drivers, the reloader that
// changes them, the HTTP server.
type daemon struct {
	log   *slog.Logger
	dir   *registrar.Dir
	sup   *registrar.Supervisor
	rl    *reload.Reloader
	httpL net.Listener // nil without an HTTP server
}

// run runs the daemon's actors until a signal (ctx ends) or a fatal error stops them.
func (d *daemon) run(ctx context.Context, hup <-chan os.Signal) error {
	log, dir, sup, rl, httpL := d.log, d.dir, d.sup, d.rl, d.httpL
	state := &daemonState{drivers: sup.Status, config: rl.State}

	// Stopped in the reverse order: the signals first, then the reloader, so that nothing
	// changes the drivers while they stop; the lock check; the supervisor, which leaves every
	// socket to the instance that took the directory when the lock check stops with
	// ErrDirLost; the HTTP server answers until everything else has stopped.
	var g group
	if httpL != nil {
		h := newHandler(state, newRegistry(sup, rl))
		httpCtx, stop := context.WithCancel(context.Background())
		g.add(func() error { return serveHTTP(httpCtx, httpL, h, log) }, func(error) { stop() })
	}
	// The lock check's own result decides how the supervisor stops, whichever actor stopped
	// first: the directory may be lost while the others stop. The check has returned before
	// the supervisor is interrupted.
	var dirErr error
	supCtx, stopSup := context.WithCancelCause(context.Background())
	g.add(counted(&state.loops, func() error { return sup.Run(supCtx) }), func(error) {
		if errors.Is(dirErr, registrar.ErrDirLost) {
			stopSup(dirErr) // the sockets are another instance's: they stay
			return
		}
		stopSup(nil) // a shutdown: the sockets stay unless --cleanup-on-exit
	})
	dirCtx, stopDir := context.WithCancel(context.Background())
	g.add(func() error {
		dirErr = dir.Run(dirCtx)
		return dirErr
	}, func(error) { stopDir() })
	rlCtx, stopRl := context.WithCancel(context.Background())
	g.add(counted(&state.loops, func() error { return rl.Run(rlCtx) }), func(error) { stopRl() })
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

// runFlags are the flags of `multireg run`.
type runFlags struct {
	path, logFormat, httpAddr string
	verbosity                 int
	cleanup                   bool
}

// parseRunFlags parses and checks the flags of `multireg run`, before anything else runs.
func parseRunFlags(args []string, stderr io.Writer) (runFlags, error) {
	var f runFlags
	fs := newFlagSet("run", stderr)
	fs.StringVar(&f.path, "config", "", "path to the drivers file (required)")
	fs.StringVar(&f.logFormat, "log-format", "text", "log format: text or json")
	fs.IntVar(&f.verbosity, "v", 0, "log verbosity: 0 logs phase changes and failures, 1 or more adds every kubelet call")
	fs.BoolVar(&f.cleanup, "cleanup-on-exit", false, "remove every registration socket on exit, so kubelet deregisters every plugin (uninstall)")
	fs.StringVar(&f.httpAddr, "http-endpoint", defaultHTTPEndpoint, "serve /healthz, /readyz, /status and /metrics on this address; empty disables")
	if err := parseFlags(fs, args); err != nil {
		return f, err
	}
	if f.path == "" {
		return f, usagef("multireg run: --config is required")
	}
	if err := checkListenAddr(f.httpAddr); err != nil {
		return f, usagef("multireg run: --http-endpoint %q: %v", f.httpAddr, err)
	}
	return f, nil
}

// counted counts execute in n from now until it returns.
func counted(n *atomic.Int32, execute func() error) func() error {
	n.Add(1)
	return func() error {
		defer n.Add(-1)
		return execute()
	}
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
