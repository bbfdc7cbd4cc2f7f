package registrar

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"
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

// registrationServer serves kubelet's Registration API on one socket generation (through
// rpcConn). GetInfo is answered from memory: kubelet allows it one second.
//
// A verdict counts only on a connection that asked this server's GetInfo. kubelet calls
// GetInfo and NotifyRegistrationStatus on one connection, but its gRPC client reconnects to
// the same path when the socket is recreated: a verdict about an older socket can then arrive
// on the new one, over a connection that never asked the new one anything.
type registrationServer struct {
	gen    uint64
	info   *registerapi.PluginInfo
	notify func(verdict)      // must not block
	onInfo func(agent string) // called on every GetInfo, with the caller's user agent; must not block
	onLate func()             // called for a verdict on a connection without GetInfo; must not block

	// awaiting: GetInfo was answered and no verdict has counted since; a hand-over tells the
	// next instance (handedSocket.AwaitsVerdict).
	awaiting atomic.Bool
	// anyConn: a verdict counts on any connection, once (a hand-over's socket whose GetInfo
	// another instance answered).
	anyConn atomic.Bool

	infoMsg []byte // info, encoded

	mu    sync.Mutex
	asked map[uint64]bool // connections that called GetInfo, until they close
}

// getInfo answers GetInfo on connection conn, a call from a client whose user agent is agent.
func (s *registrationServer) getInfo(conn uint64, agent string) ([]byte, *rpcStatus) {
	s.mu.Lock()
	s.asked[conn] = true
	s.mu.Unlock()
	s.awaiting.Store(true)
	s.onInfo(agent)
	return s.infoMsg, nil
}

// notifyStatus hands kubelet's verdict, received on connection conn, to the loop, and always
// answers normally: a failure is the loop's to handle, in the background.
func (s *registrationServer) notifyStatus(conn uint64, st *registerapi.RegistrationStatus) ([]byte, *rpcStatus) {
	s.mu.Lock()
	asked := s.asked[conn]
	s.mu.Unlock()
	if !asked && !s.anyConn.CompareAndSwap(true, false) {
		s.onLate()
		return nil, nil // RegistrationStatusResponse has no field: its encoding is empty
	}
	s.anyConn.Store(false)
	s.awaiting.Store(false)
	s.notify(verdict{gen: s.gen, registered: st.PluginRegistered, msg: st.Error})
	return nil, nil
}

// forget forgets a closed connection.
func (s *registrationServer) forget(conn uint64) {
	s.mu.Lock()
	delete(s.asked, conn)
	s.mu.Unlock()
}

// connIDs numbers connections across every generation of the process.
var connIDs atomic.Uint64

// generation is one published registration socket and the connections kubelet made to it.
// It has no accept loop of its own: the supervisor's hub accepts the socket's connections and
// gives each to it (give), to be served by a goroutine of its own until it closes.
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
	conns   map[*rpcConn]struct{} // being served
	stopped bool
	served  sync.WaitGroup // the connections' goroutines
}

// serve serves rs on l, the listening socket at path, through h. No idle or age limits:
// kubelet keeps one connection open from GetInfo to NotifyRegistrationStatus, and the
// plugin's registration in between may take minutes.
func serve(h *hub, l *net.UnixListener, path string, id fileID, rs *registrationServer) (*generation, error) {
	rs.asked = map[uint64]bool{}
	msg, err := proto.Marshal(rs.info)
	if err != nil {
		return nil, fmt.Errorf("serve the registration socket %s: encode its PluginInfo: %w", path, err)
	}
	rs.infoMsg = msg
	raw, err := l.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("serve the registration socket %s: %w", path, err)
	}
	g := &generation{gen: rs.gen, path: path, id: id, l: l, raw: raw, rs: rs, hub: h, conns: map[*rpcConn]struct{}{}}
	if err := h.add(g); err != nil {
		return nil, err
	}
	return g, nil
}

// give serves a connection accepted on g's socket, with go (the hub's goroutine starter). A
// stopped generation closes it instead.
func (g *generation) give(c net.Conn, goServe func(func())) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	rc := newRPCConn(g, c)
	g.conns[rc] = struct{}{}
	g.served.Add(1)
	goServe(func() {
		defer g.served.Done()
		rc.serve()
		g.mu.Lock()
		delete(g.conns, rc)
		g.mu.Unlock()
	})
}

// setDeadline sets c's read deadline to t, unless g is stopping (stop set it to interrupt
// the read).
func (g *generation) setDeadline(c net.Conn, t time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return false
	}
	_ = c.SetReadDeadline(t)
	return true
}

// isStopped reports whether stop was called.
func (g *generation) isStopped() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopped
}

// stopGrace bounds how long a stopping generation lets calls in flight finish: the reply to
// the NotifyRegistrationStatus that made the loop stop it must reach kubelet.
const stopGrace = time.Second

// stop stops accepting connections and closes the listener, lets each connection finish the
// calls its client began (for at most stopGrace: rpcConn) and closes it. Once it has returned, no call
// reaches rs: each connection's goroutine has ended. The socket file stays. It is idempotent.
func (g *generation) stop() {
	g.once.Do(func() {
		g.hub.remove(g)
		_ = g.l.Close()
		g.mu.Lock()
		g.stopped = true
		for rc := range g.conns {
			_ = rc.c.SetReadDeadline(time.Unix(1, 0)) // the next read fails; a reply being written is not cut
		}
		g.mu.Unlock()
		done := make(chan struct{})
		go func() {
			defer close(done)
			g.served.Wait()
		}()
		t := time.NewTimer(stopGrace)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			g.mu.Lock()
			for rc := range g.conns {
				rc.c.Close() // a client that does not read its reply
			}
			g.mu.Unlock()
			<-done
		}
	})
}
