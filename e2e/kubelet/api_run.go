//go:build !kube133 && !kube134

package kubelet

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher"
)

// startWatcher starts the plugin watcher as kubelet 1.35 and later do (plugin_manager.go,
// Run): Start(ctx, stopCh). It logs through the contextual logger of ctx, and watches until
// stopCh is closed.
func startWatcher(ctx context.Context, w *pluginwatcher.Watcher, stopCh <-chan struct{}) error {
	return w.Start(ctx, stopCh)
}
