//go:build linux

package main

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// instance is what the HTTP server reports across the process's life: the role, and while
// serving, the daemon's state and metrics.
type instance struct {
	base *prometheus.Registry // build info and the runtime: whatever the role

	mu     sync.Mutex
	role   string
	since  time.Time
	detail string
	state  *daemonState         // nil unless serving
	reg    *prometheus.Registry // the serving daemon's metrics, or base
}

func newInstance() *instance {
	base := newRegistry(nil, nil)
	return &instance{base: base, reg: base, role: roleStarting, since: time.Now()}
}

// instanceView is a consistent look at an instance.
type instanceView struct {
	Role      string
	Since     time.Time
	Detail    string
	Inherited int
	State     *daemonState
	Reg       *prometheus.Registry
}

func (in *instance) view() instanceView {
	in.mu.Lock()
	defer in.mu.Unlock()
	v := instanceView{Role: in.role, Since: in.since, Detail: in.detail, State: in.state, Reg: in.reg}
	if in.state != nil && in.state.adopted != nil {
		v.Inherited = in.state.adopted()
	}
	return v
}

func (in *instance) set(role, detail string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.role != role {
		in.since = time.Now()
	}
	in.role, in.detail, in.state, in.reg = role, detail, nil, in.base
}

// serve makes the instance report a serving daemon.
func (in *instance) serve(st *daemonState, reg *prometheus.Registry, detail string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.role, in.since, in.detail, in.state, in.reg = roleServing, time.Now(), detail, st, reg
}
