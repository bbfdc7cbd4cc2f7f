//go:build kube137

package kubelet

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/reconciler"
)

// runReconciler runs the reconciler as kubelet 1.37 does (plugin_manager.go, Run): Run(ctx),
// until ctx is cancelled, passing ctx, and its contextual logger, on to every operation and
// handler call. The caller cancels ctx on Stop.
func runReconciler(ctx context.Context, rc reconciler.Reconciler, _ <-chan struct{}) {
	rc.Run(ctx)
}
