//go:build !kube137

package kubelet

import "time"

// The cache.PluginHandler of kubelet 1.36 and older: no context.

func (h handler) ValidatePlugin(name, endpoint string, versions []string) error {
	return h.k.validate(h.typ, name, endpoint, versions)
}

func (h handler) RegisterPlugin(name, endpoint string, versions []string, _ *time.Duration) error {
	return h.k.register(h.typ, name, endpoint, versions)
}

func (h handler) DeRegisterPlugin(name, endpoint string) {
	h.k.deregister(h.typ, name, endpoint)
}
