package kubelet

import (
	"context"
	"errors"
	"log/slog"
	"sync"
)

// The plugin manager's Run says nothing to its caller: it logs msgStarted once its plugin
// watcher is running, or msgStartFailed and returns. Both lines are the same in 1.35 and 1.36
// (pkg/kubelet/pluginmanager/plugin_manager.go).
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
		s.state.once.Do(func() { close(s.state.started) })
	case msgStartFailed:
		failure := errors.New(msgStartFailed)
		r.Attrs(func(a slog.Attr) bool {
			if e, ok := a.Value.Any().(error); ok {
				failure = e
				return false
			}
			return true
		})
		s.state.mu.Lock()
		s.state.failure = failure
		s.state.mu.Unlock()
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
