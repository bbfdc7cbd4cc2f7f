package testkit

import (
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// DevicePlugin plays a device plugin's DevicePlugin service on a real socket: ListAndWatch
// reports the devices the test sets, healthy or not, and again at each change.
type DevicePlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	*Endpoint

	// guards: healthy, unhealthy, changed.
	mu                 sync.Mutex
	healthy, unhealthy int
	changed            chan struct{}
}

// StartDevicePlugin serves a device plugin at path, reporting healthy devices, until the test
// ends.
func StartDevicePlugin(t testing.TB, path string, healthy int) *DevicePlugin {
	t.Helper()
	p := &DevicePlugin{healthy: healthy, changed: make(chan struct{})}
	p.Endpoint = ServeEndpoint(t, path, func(s *grpc.Server) { pluginapi.RegisterDevicePluginServer(s, p) })
	return p
}

// SetDevices makes the plugin report healthy and unhealthy devices.
func (p *DevicePlugin) SetDevices(healthy, unhealthy int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.healthy, p.unhealthy = healthy, unhealthy
	close(p.changed)
	p.changed = make(chan struct{})
}

// ListAndWatch reports the devices, and again at each change, until the caller leaves.
func (p *DevicePlugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	for {
		p.mu.Lock()
		resp := &pluginapi.ListAndWatchResponse{}
		for i := range p.healthy + p.unhealthy {
			health := pluginapi.Healthy
			if i >= p.healthy {
				health = pluginapi.Unhealthy
			}
			resp.Devices = append(resp.Devices, &pluginapi.Device{ID: fmt.Sprintf("dev%d", i), Health: health})
		}
		changed := p.changed
		p.mu.Unlock()
		if err := s.Send(resp); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-s.Context().Done():
			return nil
		}
	}
}
