package registrar

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
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
