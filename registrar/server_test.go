package registrar

import (
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestVerdictWithoutGetInfoIgnored: kubelet's client reconnects to a recreated socket at the
// same path, so a verdict about an older socket can arrive on the new one, on a connection
// that never asked the new one's GetInfo. It must not count.
func TestVerdictWithoutGetInfoIgnored(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, nil)
	awaitSocket(t, d)
	late := dialKubelet(t, d.SocketPath)
	late.notify(t, false, "about an older socket")
	testkit.Never(t, time.Second, "a verdict without GetInfo counted", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase != Serving || st.Failures != 0
	})
	registerAndWait(t, s, d) // GetInfo, then the verdict, on one connection: counts
}

// Messages larger than an HTTP/2 frame — a PluginInfo with many versions, a long rejection
// from kubelet — go through whole.
func TestMessagesLargerThanTheTransportBuffers(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "big.csi.k8s.io")
	d := testDriver(dir, "big.csi.k8s.io", config.CSIPlugin, ep)
	d.SupportedVersions = nil
	for i := range 2000 {
		d.SupportedVersions = append(d.SupportedVersions, fmt.Sprintf("1.%d.0", i)) // ≈ 16 KiB
	}
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)

	reason := strings.Repeat("kubelet says no. ", 1000) // 17 KiB
	info := register(t, d.SocketPath, false, reason)
	if !reflect.DeepEqual(info.SupportedVersions, d.SupportedVersions) {
		t.Errorf("GetInfo returned %d versions, want all %d", len(info.SupportedVersions), len(d.SupportedVersions))
	}
	testkit.Eventually(t, 5*time.Second, "the whole rejection in lastError", func() bool {
		return strings.Contains(statusOf(s, d.Name).LastError, reason)
	})
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: %v, want %s", what, err, want)
	}
}

// TestStopAnswersTheVerdictThatStoppedIt: the loop stops a generation when kubelet's verdict
// says so (a rejection); the reply to that verdict still reaches kubelet, whose client would
// otherwise count the call failed (kubelet ≥ 1.36 then deregisters the plugin).
func TestStopAnswersTheVerdictThatStoppedIt(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	stopped := make(chan struct{})
	g.rs.notify = func(verdict) {
		go func() {
			defer close(stopped)
			g.stop()
		}()
		testkit.Eventually(t, 5*time.Second, "stop under way", g.isStopped)
	}
	k := dialKubelet(t, g.path)
	k.getInfo(t)
	k.notify(t, false, "no")
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
}

// TestStopFinishesTheCallsBegun: a call under way when stop comes is answered; the socket
// then serves nothing more, and stop returns once the call has ended.
func TestStopFinishesTheCallsBegun(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	entered, release := make(chan struct{}), make(chan struct{})
	g.rs.onInfo = func(string) { close(entered); <-release }
	k := dialKubelet(t, g.path)
	called := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := k.c.GetInfo(ctx, &registerapi.InfoRequest{})
		called <- err
	}()
	<-entered
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.stop()
	}()
	testkit.Eventually(t, 5*time.Second, "stop under way", g.isStopped)
	close(release)
	if err := <-called; err != nil {
		t.Errorf("the call begun before stop: %v, want its answer", err)
	}
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := k.c.GetInfo(ctx, &registerapi.InfoRequest{})
	if err == nil {
		t.Error("a call after stop was answered")
	}
}

// TestStopEndsIdleConnections: stop ends a connection idle between kubelet's calls (with
// GOAWAY, for its client to go elsewhere) and one that never began HTTP/2, within stopGrace.
func TestStopEndsIdleConnections(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	idle := dialKubelet(t, g.path)
	idle.getInfo(t)
	mute, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Close()
	testkit.Eventually(t, 5*time.Second, "both connections given to the server", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.served == 1 && len(g.opening) == 1
	})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.stop()
	}()
	select {
	case <-stopped:
	case <-time.After(stopGrace + 5*time.Second):
		t.Fatal("stop did not return")
	}
	_ = mute.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(mute); err != nil {
		t.Errorf("the connection that never began HTTP/2: %v, want it closed", err)
	}
	testkit.Eventually(t, 5*time.Second, "the idle connection closed", func() bool {
		return idle.conn.GetState() != connectivity.Ready
	})
}

// TestBoundsOnACall: a request over maxRequest is refused with ResourceExhausted, and the
// connection goes on serving.
func TestBoundsOnACall(t *testing.T) {
	_, gs := serveTest(t, 1)
	k := dialKubelet(t, gs[0].path)
	k.getInfo(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := k.c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: strings.Repeat("x", maxRequest)})
	wantCode(t, "a verdict of over 1 MiB", err, codes.ResourceExhausted)
	k.getInfo(t)
}
