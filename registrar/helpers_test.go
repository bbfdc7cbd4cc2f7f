package registrar

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/probe"
	"multireg.dev/multireg/internal/regserver"
	"multireg.dev/multireg/internal/testkit"
)

// testDriver is a resolved driver with fast retries, registering into dir/reg.
func testDriver(dir, name, typ, endpoint string) config.Driver {
	reg := filepath.Join(dir, "reg")
	return config.Driver{
		Registration: config.Registration{
			Name:              name,
			Type:              typ,
			Endpoint:          endpoint,
			SupportedVersions: config.DefaultVersions(typ),
			SocketName:        config.DefaultSocketName(name),
			SocketPath:        filepath.Join(reg, config.DefaultSocketName(name)),
		},
		Local: config.Local{LocalEndpoint: endpoint},
		Policy: config.Policy{
			Backoff: config.Backoff{
				InitialInterval: 50 * time.Millisecond,
				MaxInterval:     200 * time.Millisecond,
				Multiplier:      2,
			},
			WaitForEndpoint: true,
		},
	}
}

// fixtureDrivers names, by type, the driver setup starts and its endpoint's socket.
var fixtureDrivers = map[string]struct{ name, socket string }{
	config.CSIPlugin:    {"nfs.csi.k8s.io", "csi.sock"},
	config.DevicePlugin: {"vendor.example/gpu", "dp.sock"},
	config.DRAPlugin:    {"gpu.example.com", "dra.sock"},
}

// setup is the start most loop tests share. In a short directory: the endpoint of a driver of
// type typ, served at ep/ (a CSI driver's answers with the driver's name), and the driver
// (see testDriver and fixtureDrivers), started on a supervisor that runs until the test ends.
// before, if not nil, runs before the driver starts and may adjust it.
func setup(t *testing.T, typ string, before func(*config.Driver)) (*Supervisor, config.Driver, *servedEndpoint) {
	t.Helper()
	return setupDriver(t, typ, true, before)
}

// setupWaiting is setup without the endpoint: the driver waits for it.
func setupWaiting(t *testing.T, typ string, before func(*config.Driver)) (*Supervisor, config.Driver) {
	t.Helper()
	s, d, _ := setupDriver(t, typ, false, before)
	return s, d
}

func setupDriver(t *testing.T, typ string, serve bool, before func(*config.Driver)) (*Supervisor, config.Driver, *servedEndpoint) {
	t.Helper()
	return setupOpts(t, typ, serve, Options{}, before)
}

// setupOpts is setupDriver with a supervisor of opts.
func setupOpts(t *testing.T, typ string, serve bool, opts Options, before func(*config.Driver)) (*Supervisor, config.Driver, *servedEndpoint) {
	t.Helper()
	dir := testkit.ShortDir(t)
	n := fixtureDrivers[typ]
	d := testDriver(dir, n.name, typ, filepath.Join(dir, "ep", n.socket))
	if before != nil {
		before(&d)
	}
	var e *servedEndpoint
	if serve {
		csiName := ""
		if typ == config.CSIPlugin {
			csiName = d.Name
		}
		e = startEndpoint(t, d.LocalEndpoint, csiName)
	}
	s := runSupervisor(t, opts)
	s.Start(d)
	return s, d, e
}

// runSupervisor starts a supervisor and stops it, waiting for every loop, when the test ends.
func runSupervisor(t testing.TB, opts Options) *Supervisor {
	t.Helper()
	if opts.Log == nil {
		opts.Log = testkit.Logger(t)
	}
	s, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	testkit.RunUntilEnd(t, func(ctx context.Context) { s.Run(ctx) })
	return s
}

// deadSocket leaves at path a unix socket file on which nothing listens, nor ever did: a
// connection to it is refused. (A listener closed at once would accept for a moment, and a
// loop probing meanwhile would find the endpoint up.)
func deadSocket(t *testing.T, path string) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		t.Fatalf("bind %s: %v", path, err)
	}
}

func statusOf(s *Supervisor, name string) DriverStatus {
	for _, st := range s.Status() {
		if st.Name == name {
			return st
		}
	}
	return DriverStatus{}
}

func mustID(t testing.TB, path string) fsid.ID {
	t.Helper()
	id, _, err := fsid.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// kubelet is the fake kubelet side: a Registration client on one socket generation.
type kubelet = testkit.Kubelet

// The user agents of kubelet's registration client (kubelet.go).
const (
	kubelet136 = testkit.Kubelet136
	kubelet137 = testkit.Kubelet137
)

// dialKubelet dials the socket as kubelet 1.36 does.
func dialKubelet(t testing.TB, socket string) *kubelet {
	t.Helper()
	return testkit.DialKubelet(t, socket, kubelet136)
}

// dialKubeletAs dials the socket as a kubelet whose registration client's user agent is agent.
func dialKubeletAs(t testing.TB, socket, agent string) *kubelet {
	t.Helper()
	return testkit.DialKubelet(t, socket, agent)
}

// awaitSocket waits for the driver's registration socket to be published.
func awaitSocket(t testing.TB, d config.Driver) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, d.Name+"'s socket published", func() bool { return testkit.IsSocket(d.SocketPath) })
}

// registerAndWait plays kubelet accepting the driver's current socket and waits until the
// loop says Registered.
func registerAndWait(t testing.TB, s *Supervisor, d config.Driver) {
	t.Helper()
	register(t, d.SocketPath, true, "")
	testkit.Eventually(t, 5*time.Second, d.Name+" Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
}

// register plays kubelet's part for the socket now at path: GetInfo, then the verdict.
func register(t testing.TB, socket string, ok bool, msg string) *registerapi.PluginInfo {
	t.Helper()
	return testkit.Register(t, socket, kubelet136, ok, msg)
}

// registerAs is register, by a kubelet whose registration client's user agent is agent.
func registerAs(t testing.TB, socket, agent string, ok bool, msg string) *registerapi.PluginInfo {
	t.Helper()
	return testkit.Register(t, socket, agent, ok, msg)
}

// servedEndpoint is a driver's endpoint served in the test (testkit.Endpoint).
type servedEndpoint = testkit.Endpoint

// startEndpoint serves a driver endpoint at path (testkit.StartEndpoint).
func startEndpoint(t testing.TB, path, csiName string) *servedEndpoint {
	t.Helper()
	return testkit.StartEndpoint(t, path, csiName)
}

// serveEndpoint serves, at path, the services that register registers.
func serveEndpoint(t testing.TB, path string, register func(*grpc.Server)) *servedEndpoint {
	t.Helper()
	return testkit.ServeEndpoint(t, path, register)
}

// node is a CSI driver's Node service: NodeGetInfo answers the node ID, with fixed max volumes
// and topology, and counts its calls.
type node struct {
	csi.UnimplementedNodeServer
	id    string
	calls *atomic.Int32
}

func (n node) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	n.calls.Add(1)
	return &csi.NodeGetInfoResponse{
		NodeId:             n.id,
		MaxVolumesPerNode:  16,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{"topology.example.com/zone": "a"}},
	}, nil
}

// startCSINode serves a CSI driver's endpoint at path as startEndpoint does, with the Node
// service too, whose NodeGetInfo answers nodeID; calls counts its NodeGetInfo calls.
func startCSINode(t *testing.T, path, name, nodeID string) (e *servedEndpoint, calls *atomic.Int32) {
	t.Helper()
	calls = new(atomic.Int32)
	e = serveEndpoint(t, path, func(srv *grpc.Server) {
		csi.RegisterIdentityServer(srv, testkit.Identity{Name: name})
		csi.RegisterNodeServer(srv, node{id: nodeID, calls: calls})
	})
	return e, calls
}

// runSlowKubelet plays, until the test ends or the returned func is called, a kubelet whose
// registration of the plugin (RegisterPlugin, between GetInfo and NotifyRegistrationStatus)
// takes delay: one socket at a time, as kubelet handles one path, it calls GetInfo on each
// new socket at path, waits delay and sends NotifyRegistrationStatus(true). The returned func
// stops it and waits for it.
func runSlowKubelet(t *testing.T, path string, delay time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		var last fsid.ID
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if id, _, err := fsid.Stat(path); err == nil && id != last {
				last = id
				if err := registerSlowly(ctx, path, delay); err != nil {
					t.Logf("slow kubelet: %v", err)
				}
			}
		}
	}()
	stop = sync.OnceFunc(func() {
		cancel()
		<-done
	})
	t.Cleanup(stop)
	return stop
}

// registerSlowly registers the socket at path the way runSlowKubelet's kubelet does.
func registerSlowly(ctx context.Context, path string, delay time.Duration) error {
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	infoCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if _, err := c.GetInfo(infoCtx, &registerapi.InfoRequest{}); err != nil {
		return fmt.Errorf("GetInfo: %w", err)
	}
	registering := time.NewTimer(delay)
	defer registering.Stop()
	select {
	case <-ctx.Done():
		return nil
	case <-registering.C:
	}
	notifyCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := c.NotifyRegistrationStatus(notifyCtx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		return fmt.Errorf("NotifyRegistrationStatus: %w", err)
	}
	return nil
}

// bareLoop is a loop of spec in its first state that no goroutine runs, serving on a hub of
// its own (closed when the test ends), for the tests that drive its parts by hand.
func bareLoop(t testing.TB, spec config.Driver) *loop {
	t.Helper()
	hub, err := regserver.NewHub(testkit.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hub.Close() })
	d := newDriver(spec, testkit.Logger(t), nil)
	e := &env{hub: hub, moves: &deviceMoves{mode: config.MovesAuto}, probe: probe.Endpoint}
	return &loop{d: d, env: e, ctx: context.Background(), log: d.log, ep: newEndpoint(d, e), socks: sockets{d: d, env: e},
		mv: moveCheck{d: d, env: e, moves: e.moves}, p: newPacing(spec), probeB: newBackoff(spec.Backoff)}
}
