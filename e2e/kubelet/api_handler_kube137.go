//go:build kube137

package kubelet

import (
	"context"
	"time"
)

// The cache.PluginHandler of kubelet 1.37: each call takes the context of the plugin manager's
// reconciler first (pkg/kubelet/pluginmanager/cache/types.go). The handlers do not need it:
// Stop ends their waits through the Kubelet's own context.

func (h handler) ValidatePlugin(_ context.Context, name, endpoint string, versions []string) error {
	return h.k.validate(h.typ, name, endpoint, versions)
}

func (h handler) RegisterPlugin(_ context.Context, name, endpoint string, versions []string, _ *time.Duration) error {
	return h.k.register(h.typ, name, endpoint, versions)
}

func (h handler) DeRegisterPlugin(_ context.Context, name, endpoint string) {
	h.k.deregister(h.typ, name, endpoint)
}
