//go:build !kube137

package kubelet

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/reconciler"
)

// runReconciler runs the reconciler as kubelet 1.36 and older do (plugin_manager.go, Run):
// Run(stopCh), until stopCh is closed. It logs through klog's global logger.
func runReconciler(_ context.Context, rc reconciler.Reconciler, stopCh <-chan struct{}) {
	rc.Run(stopCh)
}
