package probe

import (
	"context"
	"fmt"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"multireg.dev/multireg/internal/sockfile"
)

// HealthyDevices asks the device plugin at endpoint what it tells kubelet of its devices: the
// first answer of its ListAndWatch, which kubelet's device manager reads too, and returns how
// many devices it reports Healthy, and how many in all. kubelet's allocatable view counts the
// healthy devices of the plugin it holds a client of: a plugin that reports none healthy (or
// none yet) explains a resource without devices there, and one that reports some does not.
func HealthyDevices(ctx context.Context, endpoint string) (healthy, all int, err error) {
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	conn, err := sockfile.Client(endpoint)
	if err != nil {
		return 0, 0, fmt.Errorf("endpoint %s: %w", endpoint, err)
	}
	defer conn.Close()
	stream, err := pluginapi.NewDevicePluginClient(conn).ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		return 0, 0, fmt.Errorf("device plugin ListAndWatch on %s: %w", endpoint, err)
	}
	resp, err := stream.Recv()
	if err != nil {
		return 0, 0, fmt.Errorf("device plugin ListAndWatch on %s: %w", endpoint, err)
	}
	for _, d := range resp.GetDevices() {
		if d.GetHealth() == pluginapi.Healthy {
			healthy++
		}
	}
	return healthy, len(resp.GetDevices()), nil
}
