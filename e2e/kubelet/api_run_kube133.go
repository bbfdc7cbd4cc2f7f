//go:build kube133 || kube134

package kubelet

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher"
)

// startWatcher starts the plugin watcher as kubelet 1.34 and older do (plugin_manager.go,
// Run): Start(stopCh), no context. It logs through klog's global logger, so Options.Log
// receives nothing from it.
func startWatcher(_ context.Context, w *pluginwatcher.Watcher, stopCh <-chan struct{}) error {
	return w.Start(stopCh)
}
