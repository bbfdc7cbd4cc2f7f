package kubelet

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/version"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

// handler is the cache.PluginHandler of one plugin type. Kubelet calls it from its operation
// goroutines: ValidatePlugin and RegisterPlugin between GetInfo and NotifyRegistrationStatus,
// DeRegisterPlugin when the socket is gone or has been recreated.
type handler struct {
	k   *Kubelet
	typ string
}

// Its cache.PluginHandler methods, whose signatures differ between kubelet minors, are in
// api_*.go, selected by build tags.
var _ cache.PluginHandler = handler{}

func (k *Kubelet) validate(typ, name, endpoint string, versions []string) error {
	if !k.enter() {
		return errStopped
	}
	defer k.calls.Done()

	var err error
	switch typ {
	case registerapi.CSIPlugin:
		_, err = k.validateCSI(name, versions)
	case registerapi.DRAPlugin:
		_, err = validateDRAServices(versions)
	case registerapi.DevicePlugin:
		err = validateDevicePlugin(name, versions)
	}
	if err != nil {
		err = fmt.Errorf("validate %s %q at %s: %w", typ, name, endpoint, err)
	}
	k.record(pick(err, EventValidate, EventValidateFailed), typ, name, endpoint, versions, err)
	return err
}

func (k *Kubelet) register(typ, name, endpoint string, versions []string) error {
	if !k.enter() {
		return errStopped
	}
	defer k.calls.Done()

	err := k.registerSteps(typ, name, endpoint, versions)
	if err != nil {
		err = fmt.Errorf("register %s %q at %s: %w", typ, name, endpoint, err)
	}
	k.record(pick(err, EventRegister, EventRegisterFailed), typ, name, endpoint, versions, err)
	return err
}

// registerSteps follows the order of kubelet's handlers: the type's own checks (CSI stores the
// driver first), then the slow part that reaches the endpoint, then the driver is in.
func (k *Kubelet) registerSteps(typ, name, endpoint string, versions []string) (err error) {
	switch typ {
	case registerapi.CSIPlugin:
		highest, verr := k.validateCSI(name, versions)
		if verr != nil {
			return verr
		}
		d := &csiDriver{endpoint: endpoint, highest: highest}
		k.mu.Lock()
		k.csi[name] = d
		k.mu.Unlock()
		defer func() {
			k.mu.Lock()
			defer k.mu.Unlock()
			if err != nil {
				if k.csi[name] == d {
					delete(k.csi, name)
				}
				return
			}
			d.registered = true
			k.csi[name] = d
		}()
	case registerapi.DRAPlugin:
		if _, err := validateDRAServices(versions); err != nil {
			return err
		}
		if err := k.draFree(name, endpoint); err != nil {
			return err
		}
	}

	if err := k.wait(name); err != nil {
		return err
	}
	if err := k.injectedFailure(name); err != nil {
		return err
	}
	if k.checkEndpoints {
		if err := k.checkEndpoint(endpoint); err != nil {
			return err
		}
	}
	if typ == registerapi.CSIPlugin && k.csiNode != nil {
		if err := k.csiNode(k.ctx, name, true); err != nil {
			return fmt.Errorf("error updating CSINode object with CSI driver node info: %w", err)
		}
	}

	k.mu.Lock()
	defer k.mu.Unlock()
	switch typ {
	case registerapi.DRAPlugin:
		if slices.Contains(k.dra[name], endpoint) {
			return fmt.Errorf("endpoint %s already registered for DRA driver plugin %s", endpoint, name)
		}
		k.dra[name] = append(k.dra[name], endpoint)
	case registerapi.DevicePlugin:
		if !DevicePluginsKeyedByEndpoint() {
			// The device manager replaces the client of a name that is already registered.
			k.devices[name] = []string{endpoint}
		} else if !slices.Contains(k.devices[name], endpoint) {
			// 1.37 adds a client beside those of the name's other endpoints.
			k.devices[name] = append(k.devices[name], endpoint)
		}
	}
	return nil
}

func (k *Kubelet) deregister(typ, name, endpoint string) {
	if !k.enter() {
		return
	}
	defer k.calls.Done()

	k.mu.Lock()
	switch typ {
	case registerapi.CSIPlugin:
		delete(k.csi, name) // by name, whatever the endpoint
	case registerapi.DevicePlugin:
		if !DevicePluginsKeyedByEndpoint() {
			delete(k.devices, name) // by name, whatever the endpoint
			break
		}
		k.devices[name] = slices.DeleteFunc(k.devices[name], func(e string) bool { return e == endpoint })
		if len(k.devices[name]) == 0 {
			delete(k.devices, name)
		}
	case registerapi.DRAPlugin:
		k.dra[name] = slices.DeleteFunc(k.dra[name], func(e string) bool { return e == endpoint })
		if len(k.dra[name]) == 0 {
			delete(k.dra, name)
		}
	}
	k.mu.Unlock()
	if typ == registerapi.CSIPlugin && k.csiNode != nil {
		if err := k.csiNode(k.ctx, name, false); err != nil {
			k.log.Warn("remove the CSI driver from the node's CSINode", "driver", name, "err", err)
		}
	}
	k.record(EventDeRegister, typ, name, endpoint, nil, nil)
}

// validateCSI is kubelet's CSI validateVersions: a usable version, and no driver of that name
// registered (or registering) with the same or a higher one.
func (k *Kubelet) validateCSI(name string, versions []string) (*version.Version, error) {
	highest, err := validateCSIVersions(versions)
	if err != nil {
		return nil, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if d, ok := k.csi[name]; ok && !d.highest.LessThan(highest) {
		return nil, fmt.Errorf("another driver with the same name is already registered with a higher supported version: %q", d.highest)
	}
	return highest, nil
}

// validateCSIVersions is the version check of kubelet's CSI handler: of the entries with at
// least two dotted parts (optional "v") and a major version of at most 1, the highest wins, and
// it must be a 1.x.
func validateCSIVersions(versions []string) (*version.Version, error) {
	if len(versions) == 0 {
		return nil, errors.New("plugin returned an empty list for supported versions")
	}
	highest, err := version.HighestSupportedVersion(versions)
	if err != nil {
		return nil, fmt.Errorf("none of the versions specified %q are supported: %w", versions, err)
	}
	return highest, nil
}

// draServicesSupportedByKubelet is servicesSupportedByKubelet of pkg/kubelet/cm/dra/plugin,
// the same from 1.34 to 1.37.
var draServicesSupportedByKubelet = []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}

// draServices133 are the services of 1.33's validateSupportedServices
// (pkg/kubelet/cm/dra/plugin/registration.go), most recent first; the last, v1alpha4's
// NodeService, is also its fallback for a plugin that lists none of them.
var draServices133 = []string{"v1beta1.DRAPlugin", "v1alpha3.NodeService"}

// validateDRAServices is the DRA manager's validateSupportedServices: from 1.34 the first
// entry kubelet supports is chosen, and a plugin that lists none is refused; 1.33 chooses the
// most recent service it knows that the plugin lists, and falls back to v1alpha4's whatever
// the plugin lists.
func validateDRAServices(services []string) (string, error) {
	if len(services) == 0 {
		return "", errors.New("empty list of supported gRPC services (aka supported versions)")
	}
	if DRAFallsBackToAlpha() {
		for _, s := range draServices133 {
			if slices.Contains(services, s) {
				return s, nil
			}
		}
		return draServices133[len(draServices133)-1], nil
	}
	for _, s := range services {
		if slices.Contains(draServicesSupportedByKubelet, s) {
			return s, nil
		}
	}
	return "", fmt.Errorf("none of services supported by the plugin (%q) are supported by the kubelet (%q)",
		services, draServicesSupportedByKubelet)
}

// validateDevicePlugin is the device manager's ValidatePlugin: version "v1beta1" and an
// extended resource name.
func validateDevicePlugin(name string, versions []string) error {
	if !slices.Contains(versions, "v1beta1") {
		return fmt.Errorf("manager version, v1beta1, is not among plugin supported versions %v", versions)
	}
	if !isExtendedResourceName(name) {
		return fmt.Errorf("invalid name of device plugin socket: the ResourceName %q is invalid", name)
	}
	return nil
}

// isExtendedResourceName is v1helper.IsExtendedResourceName of k8s.io/kubernetes/pkg/apis/core:
// a domain-prefixed name outside *kubernetes.io/ whose quota form is a qualified name.
func isExtendedResourceName(name string) bool {
	if !strings.Contains(name, "/") || strings.Contains(name, "kubernetes.io/") ||
		strings.HasPrefix(name, "requests.") {
		return false
	}
	return len(validation.IsQualifiedName("requests."+name)) == 0
}

// draFree fails if (name, endpoint) is already registered: one DRA plugin instance cannot
// hijack the endpoint of another.
func (k *Kubelet) draFree(name, endpoint string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if slices.Contains(k.dra[name], endpoint) {
		return fmt.Errorf("endpoint %s already registered for DRA driver plugin %s", endpoint, name)
	}
	return nil
}

// wait sleeps for the register delay of name; Stop ends it early.
func (k *Kubelet) wait(name string) error {
	k.mu.Lock()
	d := k.delay[name]
	k.mu.Unlock()
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-k.ctx.Done():
		return errStopped
	}
}

func (k *Kubelet) injectedFailure(name string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := k.fail[name]
	if n <= 0 {
		return nil
	}
	if n == 1 {
		delete(k.fail, name)
	} else {
		k.fail[name] = n - 1
	}
	return fmt.Errorf("injected registration failure (%d more to come)", n-1)
}

// checkEndpoint connects to the endpoint and hangs up, as a stand-in for the handler's first
// call to the plugin's service.
func (k *Kubelet) checkEndpoint(endpoint string) error {
	d := net.Dialer{Timeout: k.endpointTimeout}
	conn, err := d.DialContext(k.ctx, "unix", endpoint)
	if err != nil {
		return fmt.Errorf("connect to endpoint: %w", err)
	}
	return conn.Close()
}
