package registrar

import (
	"net"

	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

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

// serveOn serves the Registration service of generation gen on l, the listening socket at
// path (identity id), telling kubelet the endpoint of t and versions. With anyConn, the first
// verdict on any connection counts: kubelet asked GetInfo of another instance (a hand-over),
// and its verdict comes on a connection of its own. The socket is already open: its
// descriptor is counted, and never refused.
func (d *driver) serveOn(l *net.UnixListener, path string, id fsid.ID, gen uint64, t target, versions []string, anyConn bool) (*generation, error) {
	return d.serveClaimed(l, path, id, gen, t, versions, anyConn, nil)
}

// serveClaimed is serveOn for a socket whose descriptor was claimed (regserver.Hub.Claim).
func (d *driver) serveClaimed(l *net.UnixListener, path string, id fsid.ID, gen uint64, t target, versions []string, anyConn bool, claim *regserver.Slot) (*generation, error) {
	srv, err := regserver.Serve(d.hub, l, path, regserver.Service{
		Gen: gen,
		Info: &registerapi.PluginInfo{
			Type:              d.spec.Type,
			Name:              d.spec.Name,
			Endpoint:          t.endpoint,
			SupportedVersions: versions,
		},
		Notify: d.notify,
		OnInfo: func(agent string) {
			d.log.Debug("kubelet called GetInfo", "generation", gen, "userAgent", agent)
		},
		OnLate: func() {
			d.log.Debug("verdict on a connection that never asked this socket's GetInfo ignored: it is about an older socket", "generation", gen)
		},
		AnyConn: anyConn,
	}, claim)
	if err != nil {
		return nil, err
	}
	return &generation{srv: srv, l: l, gen: gen, path: path, id: id, at: t, vers: versions}, nil
}
