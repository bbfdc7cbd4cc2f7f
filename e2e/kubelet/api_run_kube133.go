//go:build kube133 || kube134

package kubelet

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// Kubelet 1.34 and older run the plugin manager with Run(sourcesReady, stopCh): no context. It
// and its plugin watcher log through klog's global logger, and the start-up lines do not name
// the directory. A klog LogFilter, which sees every structured log call without changing the
// output, notices those lines; klog allows setting it only before anything logs, so it is
// installed once at init. Starts are serialised, so that a start-up line belongs to the one
// plugin manager that is starting.
var (
	startMu  sync.Mutex                 // held from Run until that plugin manager has started or returned
	starting atomic.Pointer[startState] // the state of the plugin manager holding startMu
)

func init() { klog.SetLogFilter(startLineFilter{}) }

// startLineFilter passes every log call on unchanged.
type startLineFilter struct{}

func (startLineFilter) Filter(args []any) []any { return args }

func (startLineFilter) FilterF(format string, args []any) (string, []any) { return format, args }

func (startLineFilter) FilterS(msg string, keysAndValues []any) (string, []any) {
	if s := starting.Load(); s != nil {
		switch msg {
		case msgStarted:
			s.markStarted()
		case msgStartFailed:
			// klog.ErrorS hands the filter the message, not the error, which goes to klog's
			// output only.
			s.setFailure(errors.New(msgStartFailed + " (kubelet 1.34 and older log the cause through klog only)"))
		}
	}
	return msg, keysAndValues
}

// runPluginManager runs pm until stopCh is closed. ctx is unused: this plugin manager has no
// contextual logging, so Options.Log receives nothing from it.
func runPluginManager(_ context.Context, pm pluginmanager.PluginManager, sw startWatch, stopCh <-chan struct{}) {
	startMu.Lock()
	starting.Store(sw.state)
	release := sync.OnceFunc(func() {
		starting.Store(nil)
		startMu.Unlock()
	})
	defer release()
	go func() {
		select {
		case <-sw.Started():
		case <-stopCh:
		}
		release()
	}()
	pm.Run(allSourcesReady{}, stopCh)
}
