package regserver

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/internal/throttle"
)

// Hub accepts the connections of every registration socket of a supervisor in one loop, and
// gives each to its generation's gRPC server (a server's own accept loop, Serve, would park a
// goroutine in Accept for each socket, with its stack, for as long as the socket lives: 1000
// drivers, 1000 goroutines doing nothing).
//
// The loop waits on an epoll instance that holds every listening socket, itself waited on
// through Go's poller, so no thread blocks in it. A generation stops its connections itself
// (Socket.Stop), the hub being told first to forget its socket.
type Hub struct {
	log  *slog.Logger
	ep   *os.File // the epoll instance
	epRC syscall.RawConn

	// guards: socks, started, closed, dead, nsocks, conns, calls, reading, seq, and each
	// call's handled.
	mu sync.Mutex
	// socks: the sockets whose connections the loop accepts, by listening descriptor; each
	// is counted in nsocks.
	socks   map[int32]*Socket
	started bool
	closed  bool
	dead    bool // the loop ended on an error

	// The bounds (limits.go) and the descriptor budget (budget.go). lim, fdLimit and
	// fdReserve are set once, by NewHub.
	lim       limits
	fdLimit   int
	fdReserve int                // descriptors the sockets leave to the rest (budget.go)
	nsocks    int                // sockets counted against fdLimit, and claims on descriptors
	conns     map[*conn]connUse  // connections admitted and not released, and what each is doing
	calls     map[*call]struct{} // calls in flight
	reading   int                // calls in flight whose handler has not begun (call.handled)
	seq       uint64             // numbers accepts and calls' ends in their order (connUse.last)
	refusals  throttle.Warning   // the warning about connections and calls refused or cut; its own lock

	quit   chan struct{}  // closed by close
	done   chan struct{}  // closed when the loop has returned
	serves sync.WaitGroup // the connections' goroutines
}

// NewHub returns a hub that serves nothing yet; its loop starts with the first socket. Close
// stops it.
func NewHub(log *slog.Logger) (*Hub, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	// Non-blocking, so that os.NewFile puts it in Go's poller: an epoll instance is readable
	// when one of its sockets is.
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("setnonblock", err)
	}
	ep := os.NewFile(uintptr(fd), "epoll")
	rc, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return nil, err
	}
	return &Hub{
		log: log, ep: ep, epRC: rc, socks: map[int32]*Socket{}, quit: make(chan struct{}), done: make(chan struct{}), lim: defaultLimits(),
		fdLimit: fdLimit(), fdReserve: openFDs() + SpareFDs, conns: map[*conn]connUse{}, calls: map[*call]struct{}{},
		refusals: throttle.Warning{Every: throttle.Interval},
	}, nil
}

// add accepts g's connections from now on. g's descriptor is counted against the budget: the
// claim on a descriptor for it, or, without one (a socket handed over, already open: refusing it would
// free nothing), one more.
func (h *Hub) add(g *Socket, claim *Claim) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return fmt.Errorf("serve the registration socket %s: the process is stopping", g.path)
	}
	if h.dead {
		return fmt.Errorf("serve the registration socket %s: kubelet's connections can no longer be waited for (see the error logged before)", g.path)
	}
	var err error
	if cerr := h.ctl(g, func(ep, fd int) {
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(fd)}
		if err = syscall.EpollCtl(ep, syscall.EPOLL_CTL_ADD, fd, &ev); err == nil {
			h.socks[g.fd] = g
			if !claim.take() {
				h.nsocks++
			}
		}
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("serve the registration socket %s: epoll_ctl: %w", g.path, err)
	}
	if !h.started {
		h.started = true
		go func() {
			defer close(h.done)
			h.run()
		}()
	}
	return nil
}

// remove stops accepting g's connections; connections already accepted stay its server's.
// The caller closes the socket after it: the epoll instance must forget it first, because a
// copy of the socket (a hand-over's) would keep it, and its events, alive in the instance.
func (h *Hub) remove(g *Socket) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.socks[g.fd] != g {
		return // never added, or removed already
	}
	delete(h.socks, g.fd)
	h.nsocks--
	if h.closed {
		return // the epoll instance is closed, or going
	}
	_ = h.ctl(g, func(ep, fd int) { _ = syscall.EpollCtl(ep, syscall.EPOLL_CTL_DEL, fd, nil) })
}

// ctl runs f with the epoll instance's descriptor and g's listening one, both held open.
func (h *Hub) ctl(g *Socket, f func(ep, fd int)) error {
	var err error
	if cerr := h.epRC.Control(func(ep uintptr) {
		err = g.raw.Control(func(fd uintptr) { f(int(ep), int(fd)) })
	}); cerr != nil {
		return cerr
	}
	return err
}

// Close stops the loop and waits for it and for the connections it gave. Every generation
// must have stopped before: they own the connections, and one still serving would hold
// close until its client goes.
func (h *Hub) Close() {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return
	}
	h.closed = true
	started := h.started
	h.mu.Unlock()
	close(h.quit)
	h.ep.Close() // ends the loop's wait
	if started {
		<-h.done
	}
	h.serves.Wait()
}

// run accepts connections until the epoll instance is closed. An accept that fails for want
// of descriptors or memory is retried after a pause, as gRPC's own loop does, instead of
// spinning on a socket that stays readable.
func (h *Hub) run() {
	events := make([]syscall.EpollEvent, 64)
	var pause time.Duration
	for {
		var n int
		var werr error
		err := h.epRC.Read(func(fd uintptr) bool {
			n, werr = syscall.EpollWait(int(fd), events, 0)
			return n > 0 || (werr != nil && werr != syscall.EINTR)
		})
		if err != nil {
			return // closed
		}
		if werr != nil {
			// Unreachable in practice; should it happen, publishing fails from now on (add), and
			// each loop says so, rather than sockets that queue connections nobody accepts.
			h.log.Error("waiting for kubelet's connections failed; no registration socket is served", "err", os.NewSyscallError("epoll_wait", werr))
			h.mu.Lock()
			h.dead = true
			h.mu.Unlock()
			return
		}
		failed := false
		for _, ev := range events[:n] {
			if err := h.acceptOn(ev.Fd); err != nil {
				failed = true
				if pause == 0 {
					h.log.Warn("cannot accept kubelet's connection; retrying", "err", err)
				}
			}
		}
		if !failed {
			pause = 0
			continue
		}
		pause = min(max(2*pause, 5*time.Millisecond), time.Second)
		if !h.wait(pause) {
			return
		}
	}
}

// wait pauses the loop for d; false when the hub closed meanwhile.
func (h *Hub) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-h.quit:
		return false
	}
}

// acceptOn accepts one connection waiting on the listening socket fd, and serves it: epoll
// reports the socket again while more wait. The listener accepts it itself, non-blocking (a
// deadline bounds the wait should the connection have gone meanwhile): one descriptor per
// connection, and no failure after the accept, which would cost a connection already accepted
// (net.FileConn's duplicate did, at the descriptor limit).
func (h *Hub) acceptOn(fd int32) error {
	h.mu.Lock()
	g := h.socks[fd]
	h.mu.Unlock()
	if g == nil {
		return nil // removed since epoll_wait
	}
	if err := g.l.SetDeadline(time.Now().Add(acceptWait)); err != nil {
		return nil // closed since
	}
	c, err := g.l.AcceptUnix()
	if err != nil {
		var ne net.Error
		if errors.Is(err, net.ErrClosed) || (errors.As(err, &ne) && ne.Timeout()) ||
			errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EINTR) {
			return nil
		}
		return fmt.Errorf("accept a connection on %s: %w", g.path, err)
	}
	cn := h.admit(g, c)
	if cn == nil {
		c.Close()
		return nil
	}
	srv := g.give(cn)
	if srv == nil {
		h.release(cn)
		return nil // g stopped; c is closed
	}
	// Serve returns once the listener has no second connection; it blocks longer only
	// while the server stops, hence a goroutine.
	h.serves.Go(func() { _ = srv.Serve(&oneConn{c: c, addr: c.LocalAddr()}) })
	return nil
}

// acceptWait bounds an accept epoll said would not block: a connection may go before it.
const acceptWait = 50 * time.Millisecond

// oneConn is a listener that yields one connection, then fails: Serve returns, and the server
// keeps the connection.
type oneConn struct {
	addr net.Addr
	// guards: c.
	mu sync.Mutex
	c  net.Conn // until Accept takes it
}

// errServed ends a Serve call whose connection was taken.
var errServed = errors.New("connection handed to the server")

func (o *oneConn) Accept() (net.Conn, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := o.c
	o.c = nil
	if c == nil {
		return nil, errServed
	}
	return c, nil
}

// Close closes the connection if the server never took it (it had stopped).
func (o *oneConn) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.c != nil {
		o.c.Close()
		o.c = nil
	}
	return nil
}

func (o *oneConn) Addr() net.Addr { return o.addr }
