//go:build !kube133 && !kube134

package kubelet

import (
	"context"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// runPluginManager runs pm until stopCh is closed, the way kubelet 1.35 and later run it:
// Run(ctx, sourcesReady, stopCh). The plugin manager and its plugin watcher log through the
// contextual logger of ctx, which sw watches for the start-up lines. From 1.37 the reconciler
// runs until ctx is cancelled (and passes ctx on to every operation and handler call), where
// 1.36 and older stop it with stopCh: the caller cancels ctx on Stop.
func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, sw startWatch, stopCh <-chan struct{}) {
	pm.Run(klog.NewContext(ctx, logr.FromSlogHandler(sw)), allSourcesReady{}, stopCh)
}
