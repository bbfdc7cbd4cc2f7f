package kubelet

import (
	"context"
	"errors"
	"log/slog"
	"sync"
)

// The plugin manager's Run says nothing to its caller: it logs msgStarted once its plugin
// watcher is running, or msgStartFailed and returns. Both lines are the same from 1.33 to 1.37
// (pkg/kubelet/pluginmanager/plugin_manager.go); 1.35 and later log them through the contextual
// logger of Run's context, which is a startWatch, 1.34 and older through klog's global logger
// (see api_run_kube133.go).
const (
	msgStarted     = "Starting Kubelet Plugin Manager"
	msgStartFailed = "The desired_state_of_world populator (plugin watcher) starts failed!"
)

// startWatch is the slog.Handler behind the plugin manager's contextual logger: it passes
// records on to the user's handler and notices the start-up lines.
type startWatch struct {
	inner slog.Handler
	state *startState
}

type startState struct {
	started chan struct{}
	once    sync.Once
	mu      sync.Mutex
	failure error
}

func newStartWatch(inner slog.Handler) startWatch {
	return startWatch{inner: inner, state: &startState{started: make(chan struct{})}}
}

func (s startWatch) Started() <-chan struct{} { return s.state.started }

func (s *startState) markStarted() { s.once.Do(func() { close(s.started) }) }

func (s *startState) setFailure(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failure = err
}

func (s startWatch) err() error {
	s.state.mu.Lock()
	defer s.state.mu.Unlock()
	if s.state.failure == nil {
		return errors.New("plugin manager returned without logging why")
	}
	return s.state.failure
}

// Enabled must say yes at Info and above: logr asks before it builds a record.
func (s startWatch) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelInfo || s.inner.Enabled(ctx, l)
}

func (s startWatch) Handle(ctx context.Context, r slog.Record) error {
	switch r.Message {
	case msgStarted:
		s.state.markStarted()
	case msgStartFailed:
		failure := errors.New(msgStartFailed)
		r.Attrs(func(a slog.Attr) bool {
			if e, ok := a.Value.Any().(error); ok {
				failure = e
				return false
			}
			return true
		})
		s.state.setFailure(failure)
	}
	if !s.inner.Enabled(ctx, r.Level) {
		return nil
	}
	return s.inner.Handle(ctx, r)
}

func (s startWatch) WithAttrs(attrs []slog.Attr) slog.Handler {
	return startWatch{inner: s.inner.WithAttrs(attrs), state: s.state}
}

func (s startWatch) WithGroup(name string) slog.Handler {
	return startWatch{inner: s.inner.WithGroup(name), state: s.state}
}
