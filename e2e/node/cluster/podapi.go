package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"
)

// PodAPIHost is where the pods reach the API server: the node's address on the pods' network,
// the gateway of the CNI bridge. This node runs no kube-proxy, so the kubernetes Service's
// ClusterIP (10.0.0.1) leads nowhere from a pod; a pod that talks to the API server (multireg
// with its node condition) is given KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT (see
// PodAPIServer), as clusters without kube-proxy configure their node agents. The API server's
// serving certificate names this address too.
const PodAPIHost = "10.88.77.1"

// podGateway is PodAPIHost with the pods' prefix length, as the CNI bridge plugin puts it on
// the bridge for its isGateway (its ensureAddr accepts the bridge only with exactly this
// address).
const podGateway = PodAPIHost + "/24"

// PodAPIServer returns where a pod reaches the API server: PodAPIHost and a port on which the
// test process forwards each connection to the API server on 127.0.0.1 while the API server
// runs. While it is stopped (StopAPIServer) a pod's connection is refused, as a node's is when
// its control plane is gone.
func (c *Cluster) PodAPIServer() (host string, port int) { return PodAPIHost, c.ports["apiserver"] }

// makeBridge creates the pods' bridge with its gateway address before containerd's first
// sandbox would (the CNI bridge plugin then finds it, as it finds it after its first run), so
// that the pods' door to the API server can open at once. Cleanup deletes it (its name is in
// the state file since the preflight).
func (c *Cluster) makeBridge(ctx context.Context) error {
	for _, args := range [][]string{
		{"link", "add", Bridge, "type", "bridge"},
		{"addr", "add", podGateway, "dev", Bridge},
		{"link", "set", Bridge, "up"},
	} {
		if _, err := run(ctx, "ip", args...); err != nil {
			return err
		}
	}
	return nil
}

// openPodNetwork makes the pods' bridge and opens the pods' door to the API server.
func (c *Cluster) openPodNetwork(ctx context.Context) error {
	if err := c.makeBridge(ctx); err != nil {
		return err
	}
	return c.openDoor()
}

// openDoor opens the pods' door to the API server (PodAPIServer).
func (c *Cluster) openDoor() error {
	return c.door.open(net.JoinHostPort(PodAPIHost, itoa(c.ports["apiserver"])), fmt.Sprintf("127.0.0.1:%d", c.ports["apiserver"]))
}

// door forwards TCP connections from an address of the pods' network to the API server: what
// kube-proxy's rules, or a load balancer in front of the control plane, do on a real node. It
// lives in the test process: nothing of it outlives the test.
type door struct {
	mu      sync.Mutex
	l       net.Listener
	backend string
	conns   map[net.Conn]struct{}
	wg      sync.WaitGroup
}

// open listens on addr and forwards every connection to backend, until close.
func (d *door) open(addr, backend string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.l != nil {
		return errors.New("the pods' door to the API server is open already")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("the pods' door to the API server: %w", err)
	}
	d.l, d.backend = l, backend
	if d.conns == nil {
		d.conns = map[net.Conn]struct{}{}
	}
	d.wg.Go(func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return // closed
			}
			d.wg.Go(func() { d.forward(conn) })
		}
	})
	return nil
}

// forward copies conn to a new connection to the backend and back, until either side ends.
func (d *door) forward(conn net.Conn) {
	defer conn.Close()
	d.mu.Lock()
	backend, open := d.backend, d.l != nil
	d.mu.Unlock()
	if !open {
		return
	}
	up, err := net.DialTimeout("tcp", backend, 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	if !d.track(conn, up) {
		return
	}
	defer d.untrack(conn, up)
	done := make(chan struct{}, 2)
	for _, pair := range [][2]net.Conn{{up, conn}, {conn, up}} {
		go func() {
			_, _ = io.Copy(pair[0], pair[1])
			done <- struct{}{}
		}()
	}
	<-done // one side ended: end both (the deferred Closes), and the other copy with them
}

func (d *door) track(conns ...net.Conn) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.l == nil {
		return false
	}
	for _, c := range conns {
		d.conns[c] = struct{}{}
	}
	return true
}

func (d *door) untrack(conns ...net.Conn) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range conns {
		delete(d.conns, c)
	}
}

// close stops listening and ends every forwarded connection; open opens it again. Closing a
// door that is not open does nothing.
func (d *door) close() error {
	d.mu.Lock()
	l := d.l
	d.l = nil
	for c := range d.conns {
		c.Close()
	}
	clear(d.conns)
	d.mu.Unlock()
	if l == nil {
		return nil
	}
	err := l.Close()
	d.wg.Wait()
	if err != nil && !strings.Contains(err.Error(), "use of closed network connection") {
		return err
	}
	return nil
}
