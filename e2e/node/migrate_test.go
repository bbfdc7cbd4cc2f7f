package node_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/node/endpoints"
)

const csiEta = "eta.csi.multireg.test" // scenario 4f: moved from a sidecar

// sidecar plays node-driver-registrar for a CSI driver: it serves the Registration API on its
// socket in kubelet's plugins_registry, and its stop is its SIGTERM: it stops serving and
// deletes the socket.
type sidecar struct {
	path string
	srv  *grpc.Server
	done chan struct{}
}

type sidecarRegistration struct {
	registerapi.UnimplementedRegistrationServer
	info *registerapi.PluginInfo
}

func (s sidecarRegistration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return s.info, nil
}

func (sidecarRegistration) NotifyRegistrationStatus(context.Context, *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	return &registerapi.RegistrationStatusResponse{}, nil
}

func startSidecar(t *testing.T, name, endpoint string) *sidecar {
	t.Helper()
	path := filepath.Join(cl.PluginsRegistry, name+"-reg.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	s := &sidecar{path: path, srv: grpc.NewServer(), done: make(chan struct{})}
	registerapi.RegisterRegistrationServer(s.srv, sidecarRegistration{info: &registerapi.PluginInfo{
		Type: "CSIPlugin", Name: name, Endpoint: endpoint, SupportedVersions: []string{"1.0.0"},
	}})
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(l)
	}()
	t.Cleanup(s.stop)
	return s
}

// stop is the sidecar's exit: it stops serving and its socket is deleted. Safe to call twice.
func (s *sidecar) stop() {
	s.srv.Stop()
	<-s.done
	_ = os.Remove(s.path)
}

// 4f. A CSI driver moves from a node-driver-registrar sidecar to multireg, in the order the
// migration guide gives: the driver is added to the drivers file while the sidecar serves its
// socket; multireg leaves that socket alone and says why, and kubelet keeps the sidecar's
// registration; then the sidecar exits, deleting its socket, and multireg publishes its own. A
// CSINode watch measures how long the driver was missing: once, about one reconcile pass.
func scenarioMigrateFromSidecar(t *testing.T, mr *hostMultireg, config string) {
	ep, err := endpoints.StartCSI(endpointPath("eta", "csi.sock"), endpoints.CSIOptions{Name: csiEta, NodeID: "eta-node-1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Stop)
	sc := startSidecar(t, csiEta, ep.Path())
	waitUntil(t, time.Minute, "kubelet registers "+csiEta+" through the sidecar", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		return err == nil && drivers[csiEta] == "eta-node-1", fmt.Sprint(drivers, err)
	})
	theirs := fileid.Of(sc.path)
	w := watchCSINode(t)

	writeFileAtomic(t, config, hostConfig(append(entriesAfterRollingUpdate(), driverEntry(csiEta, "CSIPlugin", ep.Path()))...))
	waitUntil(t, time.Minute, "multireg to wait behind the sidecar's socket", func(ctx context.Context) (bool, string) {
		st, err := mr.status(ctx)
		if err != nil {
			return false, err.Error()
		}
		return strings.Contains(st[csiEta].LastError, "served by another process"), fmt.Sprintf("%+v", st[csiEta])
	})
	stays(t, 2*time.Second, "the sidecar's socket and registration are left alone", func(ctx context.Context) (string, error) {
		if fileid.Of(sc.path) != theirs {
			return "the sidecar's socket was replaced", nil
		}
		return "", nil
	})

	sc.stop()
	stopped := time.Now()
	waitAllRegistered(t, mr, csiEta)
	waitUntil(t, time.Minute, csiEta+" back in CSINode", func(ctx context.Context) (bool, string) {
		drivers, err := csiNodeDrivers(ctx)
		return err == nil && drivers[csiEta] == "eta-node-1", fmt.Sprint(drivers, err)
	})
	registered := time.Since(stopped)
	gaps, err := w.stop()
	if err != nil {
		t.Fatal(err)
	}
	if len(gaps[csiEta]) != 1 {
		t.Errorf("%s missing from CSINode %d times (%v), want once: when the sidecar exits", csiEta, len(gaps[csiEta]), gaps[csiEta])
	}
	longest := time.Duration(0)
	for _, g := range gaps[csiEta] {
		longest = max(longest, g)
	}
	t.Logf("migration from a sidecar: %s missing from CSINode %d time(s), longest %s; registered through multireg %s after the sidecar exited",
		csiEta, len(gaps[csiEta]), longest.Round(time.Millisecond), registered.Round(time.Millisecond))
	figures = append(figures, fmt.Sprintf("migration from a sidecar (added while it serves, then it exits): missing from CSINode %d time(s), longest %s", len(gaps[csiEta]), longest.Round(time.Millisecond)))
}
