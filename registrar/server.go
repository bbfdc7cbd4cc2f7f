package registrar

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// verdict is kubelet's answer to one socket generation.
type verdict struct {
	gen        uint64
	registered bool
	msg        string
}

// rejection is a rejecting verdict as the loop reports it.
func (v *verdict) rejection() error {
	return errors.New("kubelet rejected the registration: " + v.msg)
}

// registrationServer serves kubelet's Registration API on one socket generation. GetInfo is
// answered from memory: kubelet allows it one second.
//
// A verdict counts only on a connection that asked this server's GetInfo. kubelet calls
// GetInfo and NotifyRegistrationStatus on one connection, but its gRPC client reconnects to
// the same path when the socket is recreated: a verdict about an older socket can then arrive
// on the new one, over a connection that never asked the new one anything.
type registrationServer struct {
	registerapi.UnsafeRegistrationServer

	gen    uint64
	info   *registerapi.PluginInfo
	notify func(verdict) // must not block
	onInfo func()        // called on every GetInfo; must not block
	onLate func()        // called for a verdict on a connection without GetInfo; must not block

	// awaiting: GetInfo was answered and no verdict has counted since; a hand-over tells the
	// next instance (handedSocket.AwaitsVerdict).
	awaiting atomic.Bool
	// anyConn: a verdict counts on any connection, once (a hand-over's socket whose GetInfo
	// another instance answered).
	anyConn atomic.Bool

	mu    sync.Mutex
	asked map[uint64]bool // connections that called GetInfo, until they close
	// calls in flight, and whether close was called: see close.
	calls   int
	closed  bool
	drained chan struct{} // closed when the last call in flight ends after close
}

var _ registerapi.RegistrationServer = (*registrationServer)(nil)

// errClosing answers a call that reaches a generation after it stopped.
var errClosing = status.Error(codes.Unavailable, "the registration socket is closing")

// enter starts a call; false once close was called.
func (s *registrationServer) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.calls++
	return true
}

func (s *registrationServer) exit() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.calls--; s.calls == 0 && s.drained != nil {
		close(s.drained)
		s.drained = nil
	}
}

// close refuses every call from now on and waits for those in flight, so that no verdict
// reaches the loop once the generation has stopped. gRPC's stop does not wait for them: a
// connection kubelet dropped, or one a server no longer in use holds, may still be running
// one. The calls never block (notify, onInfo and onLate must not).
func (s *registrationServer) close() {
	s.mu.Lock()
	s.closed = true
	if s.calls == 0 {
		s.mu.Unlock()
		return
	}
	drained := make(chan struct{})
	s.drained = drained
	s.mu.Unlock()
	<-drained
}

func (s *registrationServer) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	if !s.enter() {
		return nil, errClosing
	}
	defer s.exit()
	if id, ok := ctx.Value(connIDKey{}).(uint64); ok {
		s.mu.Lock()
		s.asked[id] = true
		s.mu.Unlock()
	}
	s.awaiting.Store(true)
	s.onInfo()
	return s.info, nil
}

// NotifyRegistrationStatus hands kubelet's verdict to the loop and always answers normally:
// a failure is the loop's to handle, in the background.
func (s *registrationServer) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !s.enter() {
		return nil, errClosing
	}
	defer s.exit()
	id, _ := ctx.Value(connIDKey{}).(uint64)
	s.mu.Lock()
	asked := s.asked[id]
	s.mu.Unlock()
	if !asked && !s.anyConn.CompareAndSwap(true, false) {
		s.onLate()
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	s.anyConn.Store(false)
	s.awaiting.Store(false)
	s.notify(verdict{gen: s.gen, registered: st.PluginRegistered, msg: st.Error})
	return &registerapi.RegistrationStatusResponse{}, nil
}

// connIDKey carries a connection's number in the contexts of its calls.
type connIDKey struct{}

// HandleConn implements stats.Handler: a closed connection is forgotten.
func (s *registrationServer) HandleConn(ctx context.Context, st stats.ConnStats) {
	if _, end := st.(*stats.ConnEnd); end {
		if id, ok := ctx.Value(connIDKey{}).(uint64); ok {
			s.mu.Lock()
			delete(s.asked, id)
			s.mu.Unlock()
		}
	}
}

// TagConn implements stats.Handler: it numbers the connection.
func (s *registrationServer) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return context.WithValue(ctx, connIDKey{}, connIDs.Add(1))
}

// TagRPC implements stats.Handler.
func (s *registrationServer) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return ctx
}

// HandleRPC implements stats.Handler.
func (s *registrationServer) HandleRPC(context.Context, stats.RPCStats) {}

// connIDs numbers connections across every server of the process.
var connIDs atomic.Uint64

// generation is one published registration socket and the gRPC server on it. The server has
// no accept loop of its own: the supervisor's hub accepts the socket's connections and gives
// each to the server (give). It exists only while it has connections: kubelet connects to a
// socket to register it and is then gone, and 1000 idle servers would hold 2.5 MiB.
type generation struct {
	gen  uint64
	path string
	at   target // the endpoint its GetInfo gives kubelet
	// registered: kubelet accepted it. Only the loop's goroutine uses it.
	registered bool
	id         fileID
	l          *net.UnixListener
	raw        syscall.RawConn // l's descriptor, for the hub
	rs         *registrationServer
	hub        *hub
	once       sync.Once

	mu      sync.Mutex
	srv     *grpc.Server // nil while no connection is served
	conns   int          // connections given to srv and not closed
	stopped bool
}

// serve serves rs on l, the listening socket at path, through h. No idle or age limits:
// kubelet keeps one connection open from GetInfo to NotifyRegistrationStatus, and the
// plugin's registration in between may take minutes.
func serve(h *hub, l *net.UnixListener, path string, id fileID, rs *registrationServer) (*generation, error) {
	rs.asked = map[uint64]bool{}
	raw, err := l.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("serve the registration socket %s: %w", path, err)
	}
	g := &generation{gen: rs.gen, path: path, id: id, l: l, raw: raw, rs: rs, hub: h}
	if err := h.add(g); err != nil {
		return nil, err
	}
	return g, nil
}

// give hands a connection accepted on g's socket to g's server, started for it if none runs.
// It returns the server and the connection to serve, or nil when g has stopped (c is closed).
func (g *generation) give(c net.Conn) (*grpc.Server, net.Conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		c.Close()
		return nil, nil
	}
	if g.srv == nil {
		g.srv = grpc.NewServer(serverOptions(g.rs)...)
		registerapi.RegisterRegistrationServer(g.srv, g.rs)
	}
	g.conns++
	return g.srv, &genConn{Conn: c, g: g}
}

// closed counts a connection given to the server as closed; the server goes with the last.
func (g *generation) closed() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.conns--; g.conns == 0 && !g.stopped {
		g.srv = nil // idle: it holds no goroutine (nor a channelz entry: channelz is off), and the next connection gets a new one
	}
}

// genConn is a connection given to a generation's server. gRPC closes every connection it is
// given, whether its transport ends or never starts.
type genConn struct {
	net.Conn
	g    *generation
	once sync.Once
}

func (c *genConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.g.closed)
	return err
}

// serverOptions are a registration server's. kubelet's calls carry a few hundred bytes, so
// each connection reads and writes through 4 KiB buffers instead of gRPC's 32 KiB each way:
// kubelet registering 1000 drivers at once opens 1000 connections (larger messages still
// pass, in several reads and flushes). The write buffer goes back to a pool once flushed: a
// connection is idle from GetInfo until the verdict, while kubelet registers the plugin.
func serverOptions(rs *registrationServer) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.StatsHandler(rs),
		grpc.ReadBufferSize(4 << 10),
		grpc.WriteBufferSize(4 << 10),
		grpc.SharedWriteBuffer(true),
	}
}

// stopGrace bounds how long a stopping generation lets calls in flight finish: the reply to
// the NotifyRegistrationStatus that made the loop stop it must reach kubelet.
const stopGrace = time.Second

// stop stops accepting connections and closes the listener, lets calls in flight finish (for
// at most stopGrace) and closes every connection. Once it has returned, no call reaches rs.
// The socket file stays. It is idempotent.
func (g *generation) stop() {
	g.once.Do(func() {
		g.hub.remove(g)
		_ = g.l.Close()
		g.mu.Lock()
		g.stopped = true
		srv := g.srv
		g.mu.Unlock()
		defer g.rs.close()
		if srv == nil {
			return
		}
		graceful := make(chan struct{})
		go func() {
			defer close(graceful)
			srv.GracefulStop()
		}()
		t := time.NewTimer(stopGrace)
		defer t.Stop()
		select {
		case <-graceful:
		case <-t.C:
			srv.Stop()
			<-graceful
		}
	})
}
