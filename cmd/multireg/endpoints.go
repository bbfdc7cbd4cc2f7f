//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"multireg.dev/multireg/health"
	"multireg.dev/multireg/internal/handover"
)

// The process's TCP endpoints: --http-endpoint (status, metrics, readiness, and the drivers'
// checks at /healthz/<driver>), and the health endpoints where a driver pod's livenessProbe
// reaches the drivers' liveness checks (package health): --health-endpoint for httpGet
// probes, --health-grpc-endpoint for grpc probes.
//
// On the host's network a rolling update's two instances listen on the same ports
// (SO_REUSEPORT), and kubelet's probes of either pod reach either process. So a hand-over
// gives the new instance the old one's listening sockets, and the old one serves them no more
// once the new one has them: from then on every connection to the node's ports reaches the
// instance that serves the drivers, whichever pod kubelet probes, and no connection the kernel
// queued on them is lost when the old instance exits. The new instance then closes any it
// bound itself for the same endpoint (--http-endpoint is bound at start, to answer while the
// directory is taken): a chain of updates serves one socket, not one more each. It takes only
// sockets of its own network namespace: in the pod network each pod keeps its own.
//
// An instance that gets none (the first, or one that stands by while an instance it cannot
// speak with holds the directory) binds its own beside the other's: then the connections
// queued on the other's socket when it exits are refused (docs/health-checks.md gives the
// bound).
const (
	httpName       = "http"
	healthHTTPName = "health-http"
	healthGRPCName = "health-grpc"
)

// flagOf is the flag that gives the address of the endpoint named name.
func flagOf(name string) string {
	switch name {
	case healthHTTPName:
		return "--health-endpoint"
	case healthGRPCName:
		return "--health-grpc-endpoint"
	}
	return "--http-endpoint"
}

// healthMaxConns bounds the health HTTP endpoint's open connections: kubelet opens one for each
// probe of each driver pointed at it, and closes it after.
const healthMaxConns = 256

// endpoints serves the process's listeners.
type endpoints struct {
	log   *slog.Logger
	specs []handover.ListenerSpec // the listeners the flags ask for
	// handlers: what --http-endpoint serves, and the drivers' checks.
	handler http.Handler
	checker *health.Checker
	// fail is called when serving --http-endpoint fails: the process stops.
	fail func(error)

	mu     sync.Mutex
	served []*served
	wg     sync.WaitGroup // every server
}

// served is one listener served.
type served struct {
	spec handover.ListenerSpec
	l    net.Listener
	own  bool   // bound by this process, not handed over
	stop func() // stops serving gracefully, and closes l
}

// newEndpoints returns the endpoints of the flags: httpAddr serves h, the health endpoints
// c's checks; an empty address, none.
func newEndpoints(httpAddr string, h http.Handler, healthHTTP, healthGRPC string, c *health.Checker, fail func(error), log *slog.Logger) *endpoints {
	e := &endpoints{log: log, handler: h, checker: c, fail: fail}
	for _, spec := range []handover.ListenerSpec{{Name: httpName, Addr: httpAddr}, {Name: healthHTTPName, Addr: healthHTTP}, {Name: healthGRPCName, Addr: healthGRPC}} {
		if spec.Addr != "" {
			e.specs = append(e.specs, spec)
		}
	}
	return e
}

// ensure binds, and serves, each listener of the flags (only those named, if any) that none
// serves yet.
func (e *endpoints) ensure(names ...string) error {
	for _, spec := range e.specs {
		if len(names) > 0 && !slices.Contains(names, spec.Name) || e.serves(spec) {
			continue
		}
		l, err := listenReusePort(spec.Addr)
		if err != nil {
			return fmt.Errorf("%s %s: %w", flagOf(spec.Name), spec.Addr, err)
		}
		// The kernel gives every new connection to the oldest socket of the port's group: one
		// that joins it receives none while an older one listens, and closing it loses no
		// connection queued on it (this instance closes its own once a hand-over gives it the
		// old instance's; a standby's waits for the old one to exit).
		if err := steerToOldest(l); err != nil {
			e.log.Warn("cannot steer the port's connections to its oldest socket: both instances of a rolling update answer there, and the sockets closed in a hand-over lose what the kernel queued on them",
				"flag", flagOf(spec.Name), "address", spec.Addr, "err", err)
		}
		e.serve(spec, l, true)
	}
	return nil
}

// serves reports whether a listener of spec is served.
func (e *endpoints) serves(spec handover.ListenerSpec) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.ContainsFunc(e.served, func(s *served) bool { return s.spec == spec })
}

// wanted are the listeners a hand-over's new instance takes from the holder (handover.Ask
// takes only those): those of a fixed port. Port 0 is any free port, another for each
// instance: nothing to share.
func (e *endpoints) wanted() []handover.ListenerSpec {
	var out []handover.ListenerSpec
	for _, spec := range e.specs {
		if fixedPort(spec) {
			out = append(out, spec)
		}
	}
	return out
}

// fixedPort reports whether spec's address names a port: not 0, which is any free port.
func fixedPort(spec handover.ListenerSpec) bool {
	_, port, err := net.SplitHostPort(spec.Addr)
	return err == nil && port != "0"
}

// adopt serves the listeners a hand-over brought for the flags' addresses: the old instance's
// sockets, which no connection leaves from now on. It then stops serving those of the same
// endpoints it bound itself.
func (e *endpoints) adopt(snap *handover.Snapshot) {
	var took []handover.ListenerSpec
	for _, spec := range e.specs {
		for _, f := range snap.TakeListeners(spec) {
			l, err := net.FileListener(f)
			f.Close() // the listener holds its own descriptor
			if err != nil {
				e.log.Warn("a listener handed over cannot be served", "name", spec.Name, "addr", spec.Addr, "err", err)
				continue
			}
			e.log.Info("the previous instance's listener is served here from now on", "endpoint", spec.Name, "address", spec.Addr)
			e.serve(spec, l, false)
			took = append(took, spec)
		}
	}
	snap.DropListeners() // any other: an address this instance does not serve
	e.retire(took, true)
}

// retire stops serving the listeners of specs: only those this process bound itself, with own.
func (e *endpoints) retire(specs []handover.ListenerSpec, own bool) {
	e.mu.Lock()
	var stop []*served
	e.served = slices.DeleteFunc(e.served, func(s *served) bool {
		if slices.Contains(specs, s.spec) && (!own || s.own) {
			stop = append(stop, s)
			return true
		}
		return false
	})
	e.mu.Unlock()
	for _, s := range stop {
		s.stop()
	}
}

// handOut adds to snap a descriptor of each listener served on a fixed port, for the new
// instance (one of port 0 is no new instance's: each binds a port of its own).
func (e *endpoints) handOut(snap *handover.Snapshot) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, s := range e.served {
		if !fixedPort(s.spec) {
			continue
		}
		f, err := s.l.(*net.TCPListener).File()
		if err != nil {
			e.log.Warn("cannot hand a listener over; the new instance serves its own", "addr", s.spec.Addr, "err", err)
			continue
		}
		snap.AddListener(&handover.HandedListener{ListenerSpec: s.spec, File: f})
	}
}

// serve serves l, a listener of spec, until stop; own: bound by this process.
//
// Stopping first closes this process's descriptor of l, so that it accepts no more (where a
// hand-over gave l to a new instance, the socket stays open there, and the new instance
// accepts the next connection), and then answers every connection it accepted before: a
// server's Shutdown alone would close a connection whose request it had not read yet, a
// probe lost at each hand-over (Go's http.Server drops a request read after Shutdown began;
// gRPC's GracefulStop drops a connection not yet set up).
func (e *endpoints) serve(spec handover.ListenerSpec, l net.Listener, own bool) {
	s := &served{spec: spec, l: l, own: own}
	var closing atomic.Bool
	done := make(chan struct{}) // Serve returned: every connection it accepted is tracked
	// unwind: l closed and Serve returned, wait for the connections accepted (settled), at
	// most httpShutdown, then shut the server down.
	unwind := func(l net.Listener, settled func() <-chan struct{}, shutdown func()) {
		closing.Store(true)
		l.Close()
		<-done
		select {
		case <-settled():
		case <-time.After(httpShutdown):
		}
		shutdown()
	}
	switch spec.Name {
	case httpName, healthHTTPName:
		h, cc, write := e.handler, newConnCap(e.log), httpWriteTimeout
		if spec.Name == healthHTTPName {
			mux := http.NewServeMux()
			mux.Handle(health.Prefix, e.checker.Handler())
			// A check takes its driver's healthTimeout (at most a minute) before it answers.
			h, cc.maxConns, write = mux, healthMaxConns, time.Minute+httpWriteTimeout
		}
		srv := newHTTPServer(h, cc, write, e.log)
		e.wg.Go(func() {
			defer close(done)
			err := srv.Serve(l)
			if spec.Name == httpName && !closing.Load() && !errors.Is(err, http.ErrServerClosed) && e.fail != nil {
				e.fail(fmt.Errorf("--http-endpoint: %w", err))
			}
		})
		s.stop = func() { unwind(l, cc.settledCh, func() { shutdownHTTP(srv) }) }
	case healthGRPCName:
		srv := grpc.NewServer(
			grpc.MaxConcurrentStreams(16),
			grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second}),
			grpc.ConnectionTimeout(httpReadTimeout),
		)
		healthpb.RegisterHealthServer(srv, e.checker.GRPC())
		capped := capListener(l, healthMaxConns)
		e.wg.Go(func() {
			defer close(done)
			srv.Serve(capped)
		})
		s.stop = func() {
			unwind(capped, capped.noneOpen, func() {
				stopped := make(chan struct{})
				go func() { srv.GracefulStop(); close(stopped) }()
				select {
				case <-stopped:
				case <-time.After(httpShutdown):
					srv.Stop()
					<-stopped
				}
			})
		}
	}
	e.mu.Lock()
	e.served = append(e.served, s)
	e.mu.Unlock()
	if spec.Name == httpName {
		e.log.Info("serving HTTP", "address", l.Addr().String(), "handedOver", !own)
	} else {
		e.log.Info("serving the drivers' health checks", "endpoint", spec.Name, "address", l.Addr().String(), "handedOver", !own)
	}
}

// stop stops serving every listener (gracefully: requests begun are answered) and waits.
// Their sockets stay open where a hand-over gave them to a new instance.
func (e *endpoints) stop() {
	e.mu.Lock()
	served := e.served
	e.served = nil
	e.mu.Unlock()
	for _, s := range served {
		s.stop()
	}
	e.wg.Wait()
}

// listenReusePort listens on addr with SO_REUSEPORT, over plain TCP: a rolling update's two
// instances both listen there.
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
	// Plain TCP: Go listens with Multipath TCP where the kernel has it, and an MPTCP socket
	// refuses the steering program (EOPNOTSUPP). A probe over the loopback gains nothing by it.
	lc.SetMultipathTCP(false)
	return lc.Listen(context.Background(), "tcp", addr)
}

// steerToOldest attaches to l's SO_REUSEPORT group a classic BPF program that returns 0: the
// index of the group's first socket, which stays first until it closes (the kernel then moves
// the last one into its place). Attached after listen(2): a program attached before the
// socket joins an existing group is dropped, and the group's own is kept. Linux 4.5 on.
func steerToOldest(l net.Listener) error {
	rc, err := l.(*net.TCPListener).SyscallConn()
	if err != nil {
		return err
	}
	prog := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptSockFprog(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_REUSEPORT_CBPF, &fprog)
	}); err != nil {
		return err
	}
	return serr
}

// capListener bounds the connections open at once from l to n: one beyond waits in the
// kernel's queue until one closes.
func capListener(l net.Listener, n int) *cappedListener {
	return &cappedListener{Listener: l, sem: make(chan struct{}, n), closed: make(chan struct{})}
}

type cappedListener struct {
	net.Listener
	sem       chan struct{}
	closed    chan struct{} // Close was called: Accept waits no more
	closeOnce sync.Once

	mu   sync.Mutex
	none chan struct{} // closed, and nil again, once no connection is open (noneOpen)
}

func (c *cappedListener) Accept() (net.Conn, error) {
	select {
	case c.sem <- struct{}{}:
	case <-c.closed:
		return nil, net.ErrClosed
	}
	conn, err := c.Listener.Accept()
	if err != nil {
		c.release()
		return nil, err
	}
	return &releasedConn{Conn: conn, release: c.release}, nil
}

func (c *cappedListener) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	return c.Listener.Close()
}

func (c *cappedListener) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	<-c.sem
	if c.none != nil && len(c.sem) == 0 {
		close(c.none)
		c.none = nil
	}
}

// noneOpen is closed once no connection accepted is open.
func (c *cappedListener) noneOpen() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.sem) == 0 {
		return closedCh
	}
	if c.none == nil {
		c.none = make(chan struct{})
	}
	return c.none
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
