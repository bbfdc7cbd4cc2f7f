package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: a hostile client on a registration socket: 10,000 GetInfo and
// NotifyRegistrationStatus calls from 8 concurrent connections, with random verdicts and
// random error texts, plus raw connections that write garbage. Each Notify(false) legitimately
// makes the driver recreate its socket (its backoff is short here), so the clients redial.
//
// Afterwards multireg is alive and healthy, no other driver moved, and a real registration
// still works: kubelet's per-socket backoff has grown during the churn (that is kubelet's,
// not multireg's), so kubelet restarts, and the target ends Registered in both.
func TestHostileClient(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("y", 6)
	target := driver{Name: "target.dra.example.com", Type: "DRAPlugin", Extra: "    backoff: {initialInterval: 10ms, maxInterval: 50ms}\n"}
	p := e.startAll(append(ds, target))
	before := e.snap(ds)
	sock := e.SocketPath(target)

	const total = 10000
	var issued, ok, garbage atomic.Int64
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			conn, err := grpc.NewClient("unix://"+sock,
				grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithConnectParams(grpc.ConnectParams{
					Backoff:           backoff.Config{BaseDelay: 5 * time.Millisecond, Multiplier: 1.6, MaxDelay: 50 * time.Millisecond},
					MinConnectTimeout: time.Second,
				}))
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close()
			c := registerapi.NewRegistrationClient(conn)
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for issued.Add(1) <= total && ctx.Err() == nil {
				cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
				var err error
				switch r := rng.IntN(100); {
				case r < 45:
					var info *registerapi.PluginInfo
					info, err = c.GetInfo(cctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
					if err == nil && info.Name != target.Name {
						t.Errorf("GetInfo answered %q", info.Name)
					}
				case r < 98:
					_, err = c.NotifyRegistrationStatus(cctx, &registerapi.RegistrationStatus{
						PluginRegistered: rng.IntN(2) == 0,
						Error:            randomText(rng, rng.IntN(4096)),
					}, grpc.WaitForReady(true))
				default:
					err = writeGarbage(cctx, sock, rng)
					garbage.Add(1)
				}
				ccancel()
				if err == nil {
					ok.Add(1)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d calls, %d answered, %d garbage connections; %d sockets published", total, ok.Load(), garbage.Load(), p.Count("registration socket published", target.Name))
	if ctx.Err() != nil {
		t.Fatalf("the hostile calls did not finish in time: %d issued", issued.Load())
	}
	if ok.Load() < total/2 {
		t.Errorf("only %d of %d calls answered: the loop was not reachable", ok.Load(), total)
	}

	if p.Exited() {
		t.Fatal("multireg exited")
	}
	wait.Every(t, requestPoll, registerTimeout, "/healthz 200", func() bool { return p.Healthy(t) })
	e.assertUnmoved(before, ds)

	e.RestartKubelet()
	wait.For(t, registerTimeout, "the target and every other driver registered by the restarted kubelet", func() bool {
		return e.AllRegistered(append(ds, target))
	})
	waitPhases(t, p, append(ds, target), "Registered")
	for _, d := range ds {
		if fileid.Of(e.SocketPath(d)) != before.ids[d.Name] {
			t.Errorf("%s: socket recreated", d.Name)
		}
	}
}

// randomText returns n random printable characters.
func randomText(rng *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteByte(byte(' ' + rng.IntN(95)))
	}
	return b.String()
}

// writeGarbage connects to the socket and writes random bytes, then hangs up.
func writeGarbage(ctx context.Context, sock string, rng *rand.Rand) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return err
	}
	defer c.Close()
	b := make([]byte, 1+rng.IntN(512))
	for i := range b {
		b[i] = byte(rng.IntN(256))
	}
	c.SetDeadline(time.Now().Add(time.Second))
	_, err = c.Write(b)
	return err
}

// Fault: a verdict meant for an older socket arrives on the current one. kubelet calls GetInfo
// and NotifyRegistrationStatus on one gRPC client connection; when the socket is recreated in
// between (deleted by someone, timed out, the driver restarted), gRPC reconnects to the same
// path for the verdict, and so reaches the newer socket. The contract: "A notification that reaches
// an older socket generation is ignored." Here a client plays kubelet (no kubelet runs):
// GetInfo on the first socket, the socket is deleted and multireg publishes a new one, then
// NotifyRegistrationStatus(false) on the same client. The new socket must not be failed for
// it.
func TestStaleVerdict(t *testing.T) {
	t.Parallel()
	e := newEnvWithoutKubelet(t)
	d := driver{Name: "stale.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(d)
	p := mrproc.Start(t, e.WriteConfig([]driver{d}))
	waitPhases(t, p, []driver{d}, "Serving")
	sock := e.SocketPath(d)

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
	defer cancel()
	if _, err := c.GetInfo(ctx, &registerapi.InfoRequest{}); err != nil {
		t.Fatal(err)
	}

	first := fileid.Of(sock)
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "a new socket", func() bool { return testenv.IsSocket(sock) && fileid.Of(sock) != first })
	waitPhases(t, p, []driver{d}, "Serving")

	// The verdict about the first socket, on the same client: gRPC dials the path again.
	if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "about the first socket"}, grpc.WaitForReady(true)); err != nil {
		t.Fatal(err)
	}
	second := fileid.Of(sock)
	rejected := fmt.Sprintf(`multireg_registration_attempts_total{driver=%q,result="rejected"}`, d.Name)
	wait.Never(t, quietPeriod, "multireg failed its new socket for a verdict about the old one", func() bool {
		st, _ := p.Status(t).Driver(d.Name)
		return st.Phase != "Serving" || fileid.Of(sock) != second || mrproc.Metric(p.Metrics(t), rejected) != 0
	})
}
