package probe

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/sockfile"
)

// The calls a liveness check makes, by type of driver, as gRPC method names (what the
// csi_sidecar_operations_seconds metric calls method_name):
//   - CSI: Identity.Probe, what kubernetes-csi/livenessprobe calls: the driver says whether it
//     is ready, and one that does not say is (the CSI spec's "unset ready is ready").
//   - DRA: the standard gRPC health service's Check of the whole server (service ""). A DRA
//     driver's own service has only the calls kubelet makes to prepare and unprepare claims,
//     which a driver may serialize behind a claim being prepared: a check queued there would
//     fail while the driver works. Health.Check is answered by the server, without side
//     effects: SERVING, or Unimplemented from a driver that does not serve the health
//     service, is an answer; NOT_SERVING is the driver saying it is not well.
//   - Device plugin: DevicePlugin.GetDevicePluginOptions, the first call kubelet's device
//     manager makes, answered from the plugin's own service, without side effects.
const (
	MethodCSIProbe      = "/csi.v1.Identity/Probe"
	MethodHealthCheck   = "/grpc.health.v1.Health/Check"
	MethodPluginOptions = "/v1beta1.DevicePlugin/GetDevicePluginOptions"
)

// LiveMethod is the call Live makes for a driver of type typ.
func LiveMethod(typ string) string {
	switch typ {
	case config.CSIPlugin:
		return MethodCSIProbe
	case config.DevicePlugin:
		return MethodPluginOptions
	}
	return MethodHealthCheck
}

// ErrNotReady: the driver answered that it is not ready (CSI Probe's ready false, the health
// service's NOT_SERVING).
var ErrNotReady = errors.New("not ready")

// Live asks the driver of type typ at the socket path whether it is alive, on a connection of
// its own, within ctx: nil when it is, ErrNotReady (wrapped) when it says it is not, or the
// call's error (a gRPC status: its code is the metric's grpc_status_code).
func Live(ctx context.Context, typ, path string) error {
	conn, err := sockfile.Client(path)
	if err != nil {
		return err
	}
	defer conn.Close()
	return live(ctx, conn, typ)
}

func live(ctx context.Context, conn *grpc.ClientConn, typ string) error {
	switch typ {
	case config.CSIPlugin:
		resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			return err
		}
		if r := resp.GetReady(); r != nil && !r.GetValue() {
			return fmt.Errorf("CSI Probe: the driver says it is %w", ErrNotReady)
		}
		return nil
	case config.DevicePlugin:
		_, err := pluginapi.NewDevicePluginClient(conn).GetDevicePluginOptions(ctx, &pluginapi.Empty{})
		return err
	}
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) == codes.Unimplemented {
		return nil // the server answers; it serves no health service of its own
	}
	if err != nil {
		return err
	}
	if st := resp.GetStatus(); st != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("gRPC health: the driver says %s: %w", st, ErrNotReady)
	}
	return nil
}
