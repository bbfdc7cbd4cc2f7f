// Package regserver serves kubelet's Registration service on registration sockets: one gRPC
// server per socket generation, fed by one accept loop for every socket of the process (Hub),
// and kubelet's verdict handed to the socket's owner.
package regserver

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
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// Verdict is kubelet's answer to one socket generation.
type Verdict struct {
	Gen        uint64
	Registered bool
	Msg        string
}

// Rejection is a rejecting verdict as the loop reports it.
func (v *Verdict) Rejection() error {
	return errors.New("kubelet rejected the registration: " + v.Msg)
}

// Service is what one socket generation answers, and whom it tells.
type Service struct {
	// Gen numbers the generation; its verdicts carry it.
	Gen uint64
	// Info is GetInfo's answer.
	Info *registerapi.PluginInfo
	// Notify receives kubelet's verdict; OnInfo is called on every GetInfo, with the caller's
	// user agent; OnLate for a verdict on a connection that never asked this generation's
	// GetInfo (it is ignored). None of them may block.
	Notify func(Verdict)
	OnInfo func(agent string)
	OnLate func()
	// AnyConn: the first verdict on any connection counts: kubelet asked GetInfo of another
	// instance (a hand-over), and its verdict comes on a connection of its own.
	AnyConn bool
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
	notify func(Verdict)
	onInfo func(agent string)
	onLate func()

	// awaiting: GetInfo was answered and no verdict has counted since; a hand-over tells the
	// next instance (Awaiting).
	awaiting atomic.Bool
	// anyConn: a verdict counts on any connection, once (a hand-over's socket whose GetInfo
	// another instance answered).
	anyConn atomic.Bool

	// guards: asked.
	mu    sync.Mutex
	asked map[uint64]bool // connections that called GetInfo, until they close
}

// forget forgets connection id, closed.
func (s *registrationServer) forget(id uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.asked, id)
}

var _ registerapi.RegistrationServer = (*registrationServer)(nil)

// GetInfo answers from memory, and tells onInfo the caller's user agent.
func (s *registrationServer) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	cn := connOf(ctx)
	cn.asked.Store(true)
	s.mu.Lock()
	s.asked[cn.id] = true
	s.mu.Unlock()
	s.awaiting.Store(true)
	var agent string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("user-agent"); len(v) > 0 {
			agent = v[0]
		}
	}
	s.onInfo(agent)
	return s.info, nil
}

// NotifyRegistrationStatus hands kubelet's verdict to the loop and always answers normally:
// a failure is the loop's to handle, in the background.
func (s *registrationServer) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	s.mu.Lock()
	asked := s.asked[connOf(ctx).id]
	s.mu.Unlock()
	if !asked && !s.anyConn.CompareAndSwap(true, false) {
		s.onLate()
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	s.anyConn.Store(false)
	s.awaiting.Store(false)
	s.notify(Verdict{Gen: s.gen, Registered: st.PluginRegistered, Msg: st.Error})
	return &registerapi.RegistrationStatusResponse{}, nil
}

// connIDs numbers connections across every generation of the process.
var connIDs atomic.Uint64

// conn (limits.go) is what a generation's server knows of one connection: its number, and
// the accepted socket itself, which gRPC's transport reads unwrapped (gRPC reads an
// *net.UnixConn into a pooled buffer only once data is there, and keeps no buffer of its own
// while the connection is idle).

func (*conn) AuthType() string { return "unix" }

// connOf returns the connection a call came on.
func connOf(ctx context.Context) *conn {
	if p, ok := peer.FromContext(ctx); ok {
		if c, ok := p.AuthInfo.(*conn); ok {
			return c
		}
	}
	return &conn{g: &Socket{}} // unreachable: every connection goes through tagger
}

// Socket is one published registration socket generation and the gRPC server on it. The
// server has no accept loop of its own: the hub accepts the socket's connections and gives
// each to the server (give). Each generation has a server of its own so that stopping it
// stops its connections the way gRPC stops a server: the calls begun are answered, then
// GOAWAY.
//
// What the hub counts of a socket (its connections, its descriptor) is the hub's, under the
// hub's lock; the socket's own fields are set by Serve, or under its own lock.
type Socket struct {
	path string
	l    *net.UnixListener
	raw  syscall.RawConn // l's descriptor, for the hub
	fd   int32           // l's descriptor's number, the hub's key for the socket
	rs   *registrationServer
	hub  *Hub
	once sync.Once

	// guards: srv, opening, served, calls, stopped.
	mu  sync.Mutex
	srv *grpc.Server // nil while no connection is served
	// opening: connections given to srv whose HTTP/2 handshake has not ended; stop closes
	// them, as gRPC's stop would wait for their handshake. One whose handshake fails leaves
	// with the hub's firstCallTimeout (forget).
	opening map[net.Conn]*conn
	served  int // connections past the handshake and not closed
	calls   int // calls whose handler has not returned, on any of srv's connections
	stopped bool
}

// Bounds on what a client of a registration socket may hold (limits.go has the rest). Kubelet
// makes one call at a time on a connection, with messages of a few hundred bytes (a
// rejection's reason may run to some KiB; an acceptance has none).
const (
	maxCallStreams = 4
	// maxRequest: gRPC's own default is 4 MiB. A call in flight holds a buffer of its
	// request's declared size: with 1000 drivers, the calls the bounds allow (one per socket
	// and maxCalls) holding 64 KiB each got multireg OOM-killed under its 128 MiB limit.
	maxRequest    = 16 << 10
	maxHeaderList = 16 << 10 // a call's header block
	// window: HTTP/2 flow-control windows, stream and connection, fixed: gRPC's default
	// grows them (BDP estimation) up to 16 MiB, which a client that does not read its
	// replies, or sends without end, would hold.
	window = 64 << 10
	// readBuffer is what one read of a connection takes from gRPC's buffer pool (its default
	// is 32 KiB); a larger message takes several reads.
	readBuffer = 4 << 10
	// handshakeTimeout bounds the wait for a client's HTTP/2 preface; kubelet sends it at once.
	handshakeTimeout = 10 * time.Second
)

// Serve serves svc on l, the listening socket at path, through h, until Stop. No idle or age
// limits once a call has begun: kubelet keeps one connection open from GetInfo to
// NotifyRegistrationStatus, and the plugin's registration in between may take minutes (the
// bounds of limits.go apply). l stays the caller's: Stop closes it. claim, made for the
// socket (Hub.Claim), is taken; nil for a socket already open (a hand-over's).
func Serve(h *Hub, l *net.UnixListener, path string, svc Service, claim *Claim) (*Socket, error) {
	rs := &registrationServer{gen: svc.Gen, info: svc.Info, notify: svc.Notify, onInfo: svc.OnInfo, onLate: svc.OnLate, asked: map[uint64]bool{}}
	rs.anyConn.Store(svc.AnyConn)
	raw, err := l.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("serve the registration socket %s: %w", path, err)
	}
	var fd int32
	if err := raw.Control(func(d uintptr) { fd = int32(d) }); err != nil {
		return nil, fmt.Errorf("serve the registration socket %s: %w", path, err)
	}
	g := &Socket{path: path, l: l, raw: raw, fd: fd, rs: rs, hub: h, opening: map[net.Conn]*conn{}}
	if err := h.add(g, claim); err != nil {
		return nil, err
	}
	return g, nil
}

// give hands a connection accepted on g's socket to g's server, created for it if none
// serves. It returns the server, or nil when g has stopped (the connection is closed).
func (g *Socket) give(cn *conn) *grpc.Server {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		cn.c.Close()
		return nil
	}
	if g.srv == nil {
		g.srv = grpc.NewServer(
			grpc.Creds(tagger{g}),
			grpc.StatsHandler(connStats{g}),
			grpc.InTapHandle(g.hub.tap),
			grpc.UnaryInterceptor(g.hub.begin),
			grpc.ConnectionTimeout(handshakeTimeout),
			grpc.MaxConcurrentStreams(maxCallStreams),
			grpc.MaxRecvMsgSize(maxRequest),
			grpc.MaxHeaderListSize(maxHeaderList),
			grpc.InitialWindowSize(window),
			grpc.InitialConnWindowSize(window),
			// Replies are a few hundred bytes: written as they are, without a buffer kept for
			// each connection.
			grpc.WriteBufferSize(0),
			// Reads go into a pooled buffer of this size only once data is there: kubelet's
			// requests take a few hundred bytes.
			grpc.ReadBufferSize(readBuffer),
			grpc.WaitForHandlers(true), // stop returns once no call can reach the loop
		)
		registerapi.RegisterRegistrationServer(g.srv, g.rs)
	}
	g.opening[cn.c] = cn
	return g.srv
}

// tagger is a generation's transport credentials: none, as for kubelet's client. It gives
// each connection its number and keeps the socket unwrapped.
type tagger struct{ g *Socket }

func (t tagger) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	t.g.mu.Lock()
	cn := t.g.opening[c]
	t.g.mu.Unlock()
	if cn == nil {
		return nil, nil, fmt.Errorf("a connection to %s the hub did not admit", t.g.path) // unreachable
	}
	return c, cn, nil
}

func (tagger) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("a registration socket's credentials serve only")
}

func (tagger) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "insecure"}
}

func (t tagger) Clone() credentials.TransportCredentials { return t }

func (tagger) OverrideServerName(string) error { return nil }

// connStats follows a generation's connections (past the handshake, and closed) and its calls;
// a closed connection's GetInfo is forgotten.
type connStats struct{ g *Socket }

func (s connStats) HandleConn(ctx context.Context, st stats.ConnStats) {
	c := connOf(ctx)
	g := s.g
	switch st.(type) {
	case *stats.ConnBegin:
		g.mu.Lock()
		delete(g.opening, c.c)
		g.served++
		g.mu.Unlock()
	case *stats.ConnEnd:
		g.hub.release(c)
		g.rs.forget(c.id)
		g.mu.Lock()
		g.served--
		g.dropIdle()
		g.mu.Unlock()
	}
}

func (s connStats) HandleRPC(ctx context.Context, st stats.RPCStats) {
	g := s.g
	switch st.(type) {
	case *stats.Begin:
		g.mu.Lock()
		g.calls++
		g.mu.Unlock()
	case *stats.End: // after the call's handler returned
		if cl := callOf(ctx); cl != nil {
			cl.after()
			g.hub.endCall(cl)
		}
		g.mu.Lock()
		g.calls--
		g.dropIdle()
		g.mu.Unlock()
	}
}

func (connStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (connStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// forget forgets cn, which the hub closed before any call began on it: its handshake may
// never have ended, and then gRPC says nothing of it (no ConnEnd).
func (g *Socket) forget(cn *conn) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.opening[cn.c]; ok {
		delete(g.opening, cn.c)
		g.dropIdle()
	}
}

// dropIdle lets go of g's server once it has no connection and no call: it holds no goroutine
// then (nor a channelz entry: channelz is off), and the next connection gets a new one.
// Kubelet connects to register a socket and is then gone: 1000 idle servers would hold some
// 3 MiB. A stopped generation keeps its server for stop. mu is held.
func (g *Socket) dropIdle() {
	if g.served == 0 && g.calls == 0 && len(g.opening) == 0 && !g.stopped {
		g.srv = nil
	}
}

// Awaiting reports whether kubelet asked GetInfo and no verdict has counted since: a hand-over
// tells the next instance, to which the verdict may come.
func (g *Socket) Awaiting() bool { return g.rs.awaiting.Load() }

// isStopped reports whether Stop was called.
func (g *Socket) isStopped() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopped
}

// stopGrace bounds how long a stopping generation lets calls in flight finish: the reply to
// the NotifyRegistrationStatus that made the loop stop it must reach kubelet.
const stopGrace = time.Second

// Stop stops accepting connections and closes the listener, lets every call begun finish (for
// at most stopGrace) and closes every connection: gRPC's graceful stop, GOAWAY then close, so
// that a client retries a later call elsewhere instead of failing it. Once it has returned, no
// call reaches rs. The socket file stays. It is idempotent.
func (g *Socket) Stop() {
	g.once.Do(func() {
		g.hub.remove(g)
		_ = g.l.Close()
		g.mu.Lock()
		g.stopped = true
		srv := g.srv
		opening := g.opening
		for c := range opening {
			c.Close() // no call began on it; gRPC's stop would wait for its handshake
		}
		g.opening = nil
		g.mu.Unlock()
		for _, cn := range opening {
			g.hub.release(cn) // no ConnEnd comes for a handshake cut short
		}
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
			srv.Stop() // a client that does not read its reply, or a call that takes its time
			<-graceful
		}
	})
}
