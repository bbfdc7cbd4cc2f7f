//go:build linux

package main

import (
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/health"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/registrar"
)

// The health endpoints: the drivers' liveness checks (package health) on listeners of their
// own, where a driver pod's livenessProbe reaches them (--health-endpoint for httpGet probes,
// --health-grpc-endpoint for grpc probes), besides GET /healthz/<driver> on --http-endpoint.
// A check asks the driver, never the loops. A rolling update's hand-over gives the new
// instance the old one's listening sockets, which it serves from then on, binding none of its
// own: no connection the kernel queued on them is lost when the old instance exits, and a
// chain of updates serves one socket, not one more each. An instance that gets none (the
// first, or one that stands by while an instance it cannot speak with holds the directory)
// binds its own with SO_REUSEPORT beside the other's: then the checks queued on the other's
// socket when it exits are refused (docs/health-checks.md gives the bound).
const (
	healthHTTPName = "health-http"
	healthGRPCName = "health-grpc"
)

// healthMaxConns bounds the health HTTP endpoint's open connections: kubelet opens one for each
// probe of each driver pointed at it, and closes it after.
const healthMaxConns = 256

// healthTargets says what a check of each driver dials: the running loop's target when this
// process serves the directory (a pattern's match), else what the drivers file says (a
// pattern's newest matching socket), so that a standby instance answers checks alike.
type healthTargets struct {
	mu  sync.Mutex
	cfg *config.RegistrarConfig
	sup *registrar.Supervisor // nil while no round serves
}

func (t *healthTargets) set(cfg *config.RegistrarConfig, sup *registrar.Supervisor) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if cfg != nil {
		t.cfg = cfg
	}
	t.sup = sup
}

// get is the target of the named driver (health.New's targets).
func (t *healthTargets) get(name string) (health.Target, bool) {
	t.mu.Lock()
	cfg, sup := t.cfg, t.sup
	t.mu.Unlock()
	if sup != nil {
		if typ, local, timeout, ok := sup.Target(name); ok && local != "" {
			return health.Target{Name: name, Type: typ, Path: local, Timeout: timeout}, true
		}
	}
	for _, d := range cfg.Drivers {
		if d.Name != name {
			continue
		}
		local := d.LocalEndpoint
		if d.EndpointIsPattern() {
			local = newestSocket(local)
		}
		return health.Target{Name: name, Type: d.Type, Path: local, Timeout: d.HealthTimeout}, true
	}
	return health.Target{}, false
}

// newestSocket is the newest socket matching pattern, or "" when none does: what a pattern's
// loop registers.
func newestSocket(pattern string) string {
	ms, _ := filepath.Glob(pattern)
	var newest string
	var at time.Time
	for _, m := range ms {
		fi, err := os.Lstat(m)
		if err != nil || fi.Mode().Type() != fs.ModeSocket {
			continue
		}
		if newest == "" || fi.ModTime().After(at) {
			newest, at = m, fi.ModTime()
		}
	}
	return newest
}

// healthEndpoints serves the health listeners.
type healthEndpoints struct {
	log     *slog.Logger
	checker *health.Checker
	specs   []handover.ListenerSpec // the listeners the flags ask for

	mu     sync.Mutex
	served []*served
	wg     sync.WaitGroup // every server
}

// served is one listener served.
type served struct {
	spec handover.ListenerSpec
	l    net.Listener
	stop func() // stops serving gracefully, and closes l
}

// newHealthEndpoints returns the endpoints of the flags (none when both are empty).
func newHealthEndpoints(httpAddr, grpcAddr string, c *health.Checker, log *slog.Logger) *healthEndpoints {
	h := &healthEndpoints{log: log, checker: c}
	if httpAddr != "" {
		h.specs = append(h.specs, handover.ListenerSpec{Name: healthHTTPName, Addr: httpAddr})
	}
	if grpcAddr != "" {
		h.specs = append(h.specs, handover.ListenerSpec{Name: healthGRPCName, Addr: grpcAddr})
	}
	return h
}

// ensure binds, and serves, each listener of the flags that none serves yet.
func (h *healthEndpoints) ensure() error {
	for _, spec := range h.specs {
		if h.serves(spec) {
			continue
		}
		l, err := listenReusePort(spec.Addr)
		if err != nil {
			return fmt.Errorf("--%s-endpoint %s: %w", strings.TrimPrefix(spec.Name, "health-"), spec.Addr, err)
		}
		h.serve(spec, l)
	}
	return nil
}

// serves reports whether a listener of spec is served.
func (h *healthEndpoints) serves(spec handover.ListenerSpec) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.ContainsFunc(h.served, func(s *served) bool { return s.spec == spec })
}

// adopt serves the listeners a hand-over brought for the flags' addresses: the old instance's
// sockets, which no connection leaves from now on.
func (h *healthEndpoints) adopt(snap *handover.Snapshot) {
	for _, spec := range h.specs {
		for _, f := range snap.TakeListeners(spec) {
			l, err := net.FileListener(f)
			f.Close() // the listener holds its own descriptor
			if err != nil {
				h.log.Warn("a health listener handed over cannot be served", "name", spec.Name, "addr", spec.Addr, "err", err)
				continue
			}
			h.log.Info("the previous instance's health listener is served here from now on", "endpoint", spec.Name, "address", spec.Addr)
			h.serve(spec, l)
		}
	}
	snap.DropListeners() // any other: an address this instance does not serve
}

// handOut adds to snap a descriptor of each listener served, for the new instance.
func (h *healthEndpoints) handOut(snap *handover.Snapshot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.served {
		f, err := s.l.(*net.TCPListener).File()
		if err != nil {
			h.log.Warn("cannot hand a health listener over; the new instance serves its own", "addr", s.spec.Addr, "err", err)
			continue
		}
		snap.AddListener(&handover.HandedListener{ListenerSpec: s.spec, File: f})
	}
}

// serve serves l, a listener of spec, until stop.
func (h *healthEndpoints) serve(spec handover.ListenerSpec, l net.Listener) {
	s := &served{spec: spec, l: l}
	switch spec.Name {
	case healthHTTPName:
		mux := http.NewServeMux()
		mux.Handle(health.Prefix, h.checker.Handler())
		cc := newConnCap(h.log)
		cc.maxConns = healthMaxConns
		srv := &http.Server{
			Handler: mux, ReadHeaderTimeout: httpReadTimeout, ReadTimeout: httpReadTimeout,
			// A check takes its driver's healthTimeout (at most a minute) before it answers.
			WriteTimeout: time.Minute + httpWriteTimeout, IdleTimeout: httpIdleTimeout,
			ErrorLog: slog.NewLogLogger(h.log.Handler(), slog.LevelDebug), ConnState: cc.track,
		}
		h.wg.Go(func() { srv.Serve(l) })
		s.stop = func() {
			ctx, cancel := context.WithTimeout(context.Background(), httpShutdown)
			defer cancel()
			if srv.Shutdown(ctx) != nil {
				srv.Close()
			}
		}
	case healthGRPCName:
		srv := grpc.NewServer(
			grpc.MaxConcurrentStreams(16),
			grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second}),
			grpc.ConnectionTimeout(httpReadTimeout),
		)
		healthpb.RegisterHealthServer(srv, h.checker.GRPC())
		h.wg.Go(func() { srv.Serve(capListener(l, healthMaxConns)) })
		s.stop = func() {
			done := make(chan struct{})
			go func() { srv.GracefulStop(); close(done) }()
			select {
			case <-done:
			case <-time.After(httpShutdown):
				srv.Stop()
				<-done
			}
		}
	}
	h.mu.Lock()
	h.served = append(h.served, s)
	h.mu.Unlock()
	h.log.Info("serving the drivers' health checks", "endpoint", spec.Name, "address", l.Addr().String())
}

// stop stops serving every listener (gracefully: checks begun are answered) and waits. Their
// sockets stay open where a hand-over gave them to a new instance.
func (h *healthEndpoints) stop() {
	h.mu.Lock()
	served := h.served
	h.served = nil
	h.mu.Unlock()
	for _, s := range served {
		s.stop()
	}
	h.wg.Wait()
}

// listenReusePort listens on addr with SO_REUSEPORT: a rolling update's two instances both
// listen there, and the kernel gives each some of the connections.
func listenReusePort(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	return lc.Listen(context.Background(), "tcp", addr)
}

// capListener bounds the connections open at once from l to n: one beyond waits in the
// kernel's queue until one closes.
func capListener(l net.Listener, n int) net.Listener {
	return &cappedListener{Listener: l, sem: make(chan struct{}, n)}
}

type cappedListener struct {
	net.Listener
	sem chan struct{}
}

func (c *cappedListener) Accept() (net.Conn, error) {
	c.sem <- struct{}{}
	conn, err := c.Listener.Accept()
	if err != nil {
		<-c.sem
		return nil, err
	}
	return &releasedConn{Conn: conn, release: func() { <-c.sem }}, nil
}

type releasedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (r *releasedConn) Close() error {
	err := r.Conn.Close()
	r.once.Do(r.release)
	return err
}
