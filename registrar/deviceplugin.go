package registrar

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"multireg.dev/multireg/config"
)

// kubeletDevicePluginDir is kubelet's device-plugin directory, whatever its root directory:
// where kubelet.sock serves the device-plugin API's own Register call, and the only place a
// plugin registering itself that way can name its endpoint in (k8s.io/kubelet's
// deviceplugin/v1beta1 DevicePluginPath). kubelet also removes every socket in it when it
// starts.
const kubeletDevicePluginDir = "/var/lib/kubelet/device-plugins"

// selfRegisteredError is a device plugin whose endpoint is in kubelet's device-plugin
// directory: a plugin that registers itself through kubelet.sock, or whose socket kubelet
// removes at every start. multireg does not register it. kubelet 1.37 refuses a second
// registration of one (resource, endpoint) while the first is connected, and that refusal
// drops kubelet's record of the connected one: the endpoint is refused until kubelet restarts,
// and the resource's devices stay advertised after the plugin is gone. Older kubelets replace
// the plugin's own registration with multireg's, and drop the resource when either goes.
type selfRegisteredError struct{ endpoint string }

func (e *selfRegisteredError) Error() string {
	return fmt.Sprintf("not registered: endpoint %s is in kubelet's device-plugin directory %s, where device plugins register themselves "+
		"through kubelet.sock (and whose sockets kubelet removes when it starts). A second registration of a connected plugin makes kubelet 1.37 "+
		"refuse that endpoint until kubelet restarts. Remove the driver from the drivers file if the plugin registers itself, or move its "+
		"socket out of %s (docs/drivers.md)", e.endpoint, kubeletDevicePluginDir, kubeletDevicePluginDir)
}

// selfRegistered returns a selfRegisteredError for a device plugin whose endpoint (kubelet's
// path; any match of a pattern) is in kubelet's device-plugin directory, nil otherwise.
func selfRegistered(d config.Driver) error {
	if d.Type == config.DevicePlugin && filepath.Dir(filepath.Clean(d.Endpoint)) == kubeletDevicePluginDir {
		return &selfRegisteredError{endpoint: d.Endpoint}
	}
	return nil
}

// stayRefused holds a driver multireg does not register (err) until its loop ends: its status
// says why, once, and nothing is published or removed. A changed configuration starts a new
// loop.
func (d *driver) stayRefused(ctx context.Context, err error) {
	// Sockets a hand-over gave the loop stay where they are, served by no one, as an earlier
	// release that registered the driver left them.
	if a := d.adopted; a != nil && a.cur != nil {
		a.cur.stop()
	}
	if d.prev != nil {
		d.prev.stop()
	}
	d.adopted, d.prev = nil, nil
	d.lookPresence()
	d.update(BackingOff, err.Error(), time.Time{})
	d.log.Error("driver not registered", "err", err)
	<-ctx.Done()
}
