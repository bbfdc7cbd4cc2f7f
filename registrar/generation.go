package registrar

import (
	"net"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/regserver"
)

// generation is one registration socket a driver's loop published (or a hand-over gave it):
// the socket served by regserver, and what the loop knows of it.
type generation struct {
	srv  *regserver.Socket
	l    *net.UnixListener
	gen  uint64
	path string
	id   fsid.ID
	at   target   // the endpoint its GetInfo gives kubelet
	vers []string // the versions its GetInfo gives kubelet
	// registered: kubelet accepted it. Only the loop's goroutine uses it.
	registered bool
}

// stop stops serving g (regserver.Socket.Stop); its file stays.
func (g *generation) stop() { g.srv.Stop() }

// awaiting reports whether kubelet asked g's GetInfo and its verdict has not come.
func (g *generation) awaiting() bool { return g.srv.Awaiting() }
