package registrar

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"multireg.dev/multireg/config"
)

// TestEndpointDirectoryAppearsLater: at node boot multireg may start before the driver has
// created its directory, whose creation cannot be watched; the driver must still be picked up
// within seconds, not after the backoff interval.
func TestEndpointDirectoryAppearsLater(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock") // ep/ does not exist yet
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	d.Backoff.InitialInterval = time.Minute
	d.Backoff.MaxInterval = time.Minute
	s := runSupervisor(t, Options{})
	s.Start(d)
	eventually(t, 5*time.Second, "WaitingForEndpoint", func() bool { return statusOf(s, d.Name).Phase == WaitingForEndpoint })
	startEndpoint(t, ep, "nfs.csi.k8s.io") // creates the directory, then the socket
	eventually(t, 5*time.Second, "the socket once the endpoint is up", func() bool { return isSocket(d.SocketPath) })
}

// TestEndpointUpInSharedDirectory: with waitForEndpoint false, a driver whose endpoint
// directory another loop already watches still reports its endpoint as up.
func TestEndpointUpInSharedDirectory(t *testing.T) {
	dir := shortDir(t)
	ep1, ep2 := filepath.Join(dir, "ep", "a.sock"), filepath.Join(dir, "ep", "b.sock")
	startEndpoint(t, ep1, "")
	startEndpoint(t, ep2, "")
	a := testDriver(dir, "vendor.example/a", config.DevicePlugin, ep1)
	b := testDriver(dir, "vendor.example/b", config.DevicePlugin, ep2)
	a.WaitForEndpoint, b.WaitForEndpoint = false, false
	s := runSupervisor(t, Options{})
	s.Start(a)
	eventually(t, 5*time.Second, "a's endpoint up", func() bool { return statusOf(s, a.Name).EndpointUp })
	s.Start(b)
	eventually(t, 5*time.Second, "b's endpoint up", func() bool { return statusOf(s, b.Name).EndpointUp })
}

// TestEndpointChmodIsNoRestart: drivers often chmod their socket after listening; that is no
// restart and must not re-register the plugin.
func TestEndpointChmodIsNoRestart(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	registerAndWait(t, s, d)
	first := mustID(t, d.SocketPath)
	if err := os.Chmod(ep, 0o660); err != nil {
		t.Fatal(err)
	}
	never(t, 1500*time.Millisecond, "a chmod of the endpoint re-registered the driver", func() bool {
		return mustID(t, d.SocketPath) != first || statusOf(s, d.Name).Attempts != 1
	})
	if !statusOf(s, d.Name).EndpointUp {
		t.Error("endpoint reported down after a chmod")
	}
}

// TestRegistrationBackoffIndependentOfEndpointWait: a long wait for the endpoint must not
// make the first registration failure after it wait the longest interval.
func TestRegistrationBackoffIndependentOfEndpointWait(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	if err := os.MkdirAll(filepath.Dir(ep), 0o755); err != nil {
		t.Fatal(err)
	}
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	d.Backoff = config.Backoff{InitialInterval: 100 * time.Millisecond, MaxInterval: 30 * time.Second, Multiplier: 4}
	s := runSupervisor(t, Options{})
	s.Start(d)
	// 100ms, 400ms, 1.6s: after about 2 s the endpoint wait is at 6.4 s.
	eventually(t, 10*time.Second, "a long wait for the endpoint", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase == WaitingForEndpoint && time.Until(st.NextAttempt) > 3*time.Second
	})
	startEndpoint(t, ep, "") // wakes the loop at once
	awaitSocket(t, d)
	register(t, d.SocketPath, false, "no")
	eventually(t, 5*time.Second, "BackingOff", func() bool { return statusOf(s, d.Name).Phase == BackingOff })
	if wait := time.Until(statusOf(s, d.Name).NextAttempt); wait > time.Second {
		t.Errorf("first registration retry in %s, want the initial interval (100ms)", wait)
	}
}

// TestConcurrentStartsOfOneName: concurrent restarts of one driver leave exactly one loop,
// which Stop stops.
func TestConcurrentStartsOfOneName(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() { s.Start(d) })
	}
	wg.Wait()
	awaitSocket(t, d)
	s.Stop(d.Name)
	if _, err := os.Lstat(d.SocketPath); !os.IsNotExist(err) {
		t.Fatalf("socket after Stop: %v", err)
	}
	never(t, time.Second, "a loop survived Stop and published again", func() bool {
		_, err := os.Lstat(d.SocketPath)
		return err == nil
	})
}

// TestPublishNeverReplacesWhatAppears: a non-socket that appears at the path between the
// check and the rename is put back untouched.
func TestPublishNeverReplacesWhatAppears(t *testing.T) {
	for _, exists := range []bool{false, true} {
		dir := shortDir(t)
		tmp, path := filepath.Join(dir, tempSocketName()), filepath.Join(dir, "x-reg.sock")
		l, err := listenUnlinked(tmp)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if err := os.WriteFile(path, []byte("precious"), 0o644); err != nil {
			t.Fatal(err)
		}
		err = renameOnto(tmp, path, exists)
		if _, ok := errors.AsType[*notSocketError](err); !ok {
			t.Errorf("exists=%v: renameOnto over a file: %v, want a not-a-socket error", exists, err)
		}
		if b, err := os.ReadFile(path); err != nil || string(b) != "precious" {
			t.Errorf("exists=%v: the file: %q, %v", exists, b, err)
		}
		if !isSocket(tmp) {
			t.Errorf("exists=%v: our socket is not back under its temporary name", exists)
		}
	}
}

func TestTempSocketNames(t *testing.T) {
	n := tempSocketName()
	if len(n) != config.TempSocketNameLen || !isTempSocketName(n) {
		t.Errorf("tempSocketName() = %q (%d bytes), want %d bytes and recognized", n, len(n), config.TempSocketNameLen)
	}
	for _, name := range []string{".mr-0123abcg.tmp", ".mr-0123abc.tmp", "mr-0123abcd.tmp", ".mr-0123abcd.sock"} {
		if isTempSocketName(name) {
			t.Errorf("%q taken for a temporary socket", name)
		}
	}
}

// TestHungEndpointProbedConcurrently: while one driver's probe hangs on an endpoint that
// accepted the connection and never answers, another driver publishes its socket.
func TestHungEndpointProbedConcurrently(t *testing.T) {
	dir := shortDir(t)
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
	eventually(t, 5*time.Second, "the healthy driver's socket", func() bool { return isSocket(ok.SocketPath) })
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

// TestEndpointDirectoriesAppearLevelByLevel: two missing levels under the endpoint; each
// creation is seen through the nearest existing ancestor, with no poll and no backoff wait.
func TestEndpointDirectoriesAppearLevelByLevel(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "a", "b", "csi.sock")
	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
	d.Backoff.InitialInterval = time.Hour
	d.Backoff.MaxInterval = time.Hour
	s := runSupervisor(t, Options{})
	s.Start(d)
	backingOff := func() bool {
		st := statusOf(s, d.Name)
		return st.LastError != "" && time.Until(st.NextAttempt) > 10*time.Minute
	}
	eventually(t, 5*time.Second, "the first probe failed, the next in an hour", backingOff)
	eventually(t, 5*time.Second, "a watch for a/", func() bool { return watchesFor(s, dir, "a") })
	if err := os.Mkdir(filepath.Join(dir, "a"), 0o755); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "quick probes once a/ appeared", func() bool {
		return time.Until(statusOf(s, d.Name).NextAttempt) < 2*time.Second
	})
	eventually(t, 10*time.Second, "the quick probes over, the next in an hour again", backingOff)
	eventually(t, 5*time.Second, "a watch for a/b/", func() bool { return watchesFor(s, filepath.Join(dir, "a"), "b") })
	startEndpoint(t, ep, "nfs.csi.k8s.io") // creates a/b/ and the socket
	eventually(t, 5*time.Second, "the socket", func() bool { return isSocket(d.SocketPath) })
}

// TestEndpointDirectoryRecreatedWhileServing: with waitForEndpoint false the socket is
// published at once; the endpoint's directory, missing then, is watched for through its
// ancestor, and the endpoint is reported up as soon as it exists.
func TestEndpointDirectoryRecreatedWhileServing(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	d.WaitForEndpoint = false
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	if statusOf(s, d.Name).EndpointUp {
		t.Fatal("endpoint up before it exists")
	}
	startEndpoint(t, ep, "")
	eventually(t, 5*time.Second, "the endpoint reported up", func() bool { return statusOf(s, d.Name).EndpointUp })
}

// TestVerdictWithoutGetInfoIgnored: kubelet's client reconnects to a recreated socket at the
// same path, so a verdict about an older socket can arrive on the new one, on a connection
// that never asked the new one's GetInfo. It must not count.
func TestVerdictWithoutGetInfoIgnored(t *testing.T) {
	dir := shortDir(t)
	ep := filepath.Join(dir, "ep", "dp.sock")
	startEndpoint(t, ep, "")
	d := testDriver(dir, "vendor.example/gpu", config.DevicePlugin, ep)
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
	late := dialKubelet(t, d.SocketPath)
	late.notify(t, false, "about an older socket")
	never(t, time.Second, "a verdict without GetInfo counted", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase != Serving || st.Failures != 0
	})
	registerAndWait(t, s, d) // GetInfo, then the verdict, on one connection: counts
}
