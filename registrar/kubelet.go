package registrar

import (
	"log/slog"
	"regexp"
	"strconv"
	"sync/atomic"
)

// kubeletClient is what multireg knows of the kubelet that registers its sockets: the user
// agent of kubelet's registration client, which names the gRPC release kubelet was built with.
// multireg has no access to the API server, and nothing else kubelet sends tells its version.
// Each Kubernetes minor pins one gRPC minor for all its patch releases:
//
//	kubelet  1.32  1.33  1.34  1.35  1.36  1.37
//	grpc-go  1.65  1.68  1.72  1.72  1.79  1.82
//
// It decides one thing only: whether a device plugin that moves to a new endpoint is registered
// beside the old one (keepsDeviceEndpoints). Anything it cannot read is taken for an older
// kubelet, which gets what every kubelet accepts: a new registration after the old one goes.
type kubeletClient struct {
	log   *slog.Logger
	agent atomic.Pointer[string]
}

// deviceEndpointsGRPC is the first gRPC minor of a kubelet whose device manager keeps several
// endpoints per resource, keyed by socket (1.37: pkg/kubelet/cm/devicemanager, endpointStore),
// and removes only the endpoint deregistered; older ones keep one per resource name, and a
// plugin's second registration replaces the first, which a deregistration of either ends.
const deviceEndpointsGRPC = 82

var grpcGoAgent = regexp.MustCompile(`\bgrpc-go/1\.(\d+)\.`)

// saw records the user agent of a GetInfo call, and logs what it tells when it changes (a
// kubelet upgraded in place).
func (k *kubeletClient) saw(agent string) {
	if k == nil || agent == "" {
		return
	}
	if old := k.agent.Swap(&agent); old != nil && *old == agent {
		return
	}
	if k.log != nil {
		k.log.Info("kubelet's registration client", "userAgent", agent,
			"deviceEndpointsKept", keepsDeviceEndpoints(agent))
	}
}

// keepsDeviceEndpoints reports whether the kubelet last seen keeps several endpoints of one
// device plugin: false until kubelet has called GetInfo.
func (k *kubeletClient) keepsDeviceEndpoints() bool {
	if k == nil {
		return false
	}
	a := k.agent.Load()
	return a != nil && keepsDeviceEndpoints(*a)
}

// keepsDeviceEndpoints reads a user agent (see kubeletClient).
func keepsDeviceEndpoints(agent string) bool {
	m := grpcGoAgent.FindStringSubmatch(agent)
	if m == nil {
		return false
	}
	minor, err := strconv.Atoi(m[1])
	return err == nil && minor >= deviceEndpointsGRPC
}

// userAgent is the user agent kubelet last registered a socket with, "" before any.
func (k *kubeletClient) userAgent() string {
	if k == nil {
		return ""
	}
	if a := k.agent.Load(); a != nil {
		return *a
	}
	return ""
}
