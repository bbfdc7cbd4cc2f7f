package registrar

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/testkit"
)

// TestProbeAnyPath: a CSI driver whose endpoint path holds bytes that mean something in a URL
// ('#', '%', '?', a space) is published: validation accepts such paths, and the probe dials
// them as they are (probe.TestEndpointAnyPath).
func TestProbeAnyPath(t *testing.T) {
	dir := testkit.ShortDir(t)
	startEndpoint(t, filepath.Join(dir, "a #%25?b", "a #%25?b.sock"), "nfs.csi.k8s.io")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "a #%25?b", "a #%25?b.sock"))
	// As validation has it: only localEndpoint may hold such bytes (kubelet's gRPC client
	// reads endpoint as a URL), and a '?' there is no pattern.
	d.Endpoint = filepath.Join(dir, "csi.sock")
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
}

// TestHungEndpointProbedConcurrently: while one driver's probe hangs on an endpoint that
// accepted the connection and never answers, another driver publishes its socket.
func TestHungEndpointProbedConcurrently(t *testing.T) {
	dir := testkit.ShortDir(t)
	hungPath := filepath.Join(dir, "hung", "csi.sock")
	if err := os.MkdirAll(filepath.Dir(hungPath), 0o755); err != nil {
		t.Fatal(err)
	}
	hung, err := net.Listen("unix", hungPath)
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := hung.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	s := runSupervisor(t, Options{})
	s.Start(testDriver(dir, "hung.csi.k8s.io", config.CSIPlugin, hungPath))

	// The probe dials twice: a plain connect, then gRPC's. Wait for the gRPC one: the probe
	// now waits for an answer that never comes.
	var conns []net.Conn
	for len(conns) < 2 {
		select {
		case c := <-accepted:
			conns = append(conns, c)
		case <-time.After(5 * time.Second):
			t.Fatal("the hung endpoint was never dialled")
		}
	}
	grpcConn := conns[1]
	defer grpcConn.Close()

	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "nfs.csi.k8s.io")
	ok := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	s.Start(ok)
	testkit.Eventually(t, 5*time.Second, "the healthy driver's socket", func() bool { return testkit.IsSocket(ok.SocketPath) })
	// The hung probe is still waiting: its connection is open.
	grpcConn.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	var buf [1024]byte
	for {
		_, err := grpcConn.Read(buf[:])
		if err == nil {
			continue // gRPC's preface and settings
		}
		if ne, isNet := err.(net.Error); !isNet || !ne.Timeout() {
			t.Fatalf("the hung probe ended before the other driver published: %v", err)
		}
		break
	}
}

// TestRetryNeedsNoProbePlace: a driver kubelet refused retries at once after its backoff,
// while every place of the endpoint probes is taken by other drivers' first probes (the
// start-up burst of a thousand drivers): its endpoint answered a moment ago, its socket is the
// same file, and the retry does not wait for a place to ask again. (It waited behind the
// burst: 2.3-2.6 s at 1000 drivers on a node, where the backoff is 0.4-0.6 s.)
func TestRetryNeedsNoProbePlace(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
	startEndpoint(t, d.LocalEndpoint, d.Name)
	var others []config.Driver
	for i := range probe.MaxInFlight {
		o := testDriver(dir, fmt.Sprintf("o%d.csi.k8s.io", i), config.CSIPlugin, filepath.Join(dir, "ep", fmt.Sprintf("o%d.sock", i)))
		startEndpoint(t, o.LocalEndpoint, o.Name)
		others = append(others, o)
	}
	held := make(chan struct{})
	var holding atomic.Int32
	s := runSupervisor(t, Options{})
	s.env.probe = func(ctx context.Context, spec config.Driver) error {
		if spec.Name != d.Name {
			holding.Add(1)
			select { // every other driver's probe takes its place until the test ends
			case <-held:
			case <-ctx.Done():
			}
		}
		return probe.Endpoint(ctx, spec)
	}
	t.Cleanup(func() { close(held) })
	s.Start(d)
	awaitSocket(t, d)
	first := mustID(t, d.SocketPath)
	for _, o := range others {
		s.Start(o)
	}
	testkit.Eventually(t, 5*time.Second, "every place taken", func() bool { return holding.Load() == probe.MaxInFlight })
	at := time.Now()
	register(t, d.SocketPath, false, "no")
	testkit.Eventually(t, 5*time.Second, "the socket published again", func() bool {
		id, _, err := fsid.Stat(d.SocketPath)
		return err == nil && id != first
	})
	t.Logf("published again %s after kubelet's refusal, every probe place taken", time.Since(at).Round(time.Millisecond))
}
