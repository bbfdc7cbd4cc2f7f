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
	base  *prometheus.Registry // build info and the runtime: whatever the role
	roles *prometheus.Registry // multireg_instance_role: whatever the role

	// guards: role, since, detail, state, reg. base and roles are set by newInstance.
	mu     sync.Mutex
	role   string
	since  time.Time
	detail string
	state  *daemonState         // nil unless serving
	reg    *prometheus.Registry // the serving daemon's metrics, or base
	// handing: the serving daemon is handing the directory over to a new instance (its
	// loops stopped): not ready, whichever pod asks (on the host's network, the new pod's
	// probes may reach this process until the new instance has its listeners).
	handing bool
}

func newInstance() *instance {
	base := newRegistry(nil, nil, nil)
	in := &instance{base: base, reg: base, roles: prometheus.NewRegistry(), role: roleStarting, since: time.Now()}
	in.roles.MustRegister(roleCollector{in})
	return in
}

// always registers c's metrics whatever the role: the drivers' liveness checks are answered
// in every role.
func (in *instance) always(c prometheus.Collector) { in.roles.MustRegister(c) }

// gatherer is what /metrics serves: the role's registry and the instance's role.
func (v instanceView) gatherer(in *instance) prometheus.Gatherer {
	return prometheus.Gatherers{v.Reg, in.roles}
}

// roles lists every role, as multireg_instance_role labels them.
var roles = []string{roleStarting, roleServing, roleStandby, roleIdle}

// roleCollector exposes the instance's role: an instance that serves nothing (standby, idle,
// still starting) for longer than a rollout takes is an alert (MultiregInstanceNotServing).
type roleCollector struct{ in *instance }

var roleDesc = prometheus.NewDesc("multireg_instance_role",
	"1 for the role this process has (starting, serving, standby, idle), 0 for the others. Only a serving instance registers drivers: a standby waits for the directory, an idle one handed it over.",
	[]string{"role"}, nil)

func (roleCollector) Describe(ch chan<- *prometheus.Desc) { ch <- roleDesc }

func (c roleCollector) Collect(ch chan<- prometheus.Metric) {
	role := c.in.view().Role
	for _, r := range roles {
		v := 0.0
		if r == role {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(roleDesc, prometheus.GaugeValue, v, r)
	}
}

// instanceView is a consistent look at an instance.
type instanceView struct {
	Role      string
	Since     time.Time
	Detail    string
	TakenOver int
	State     *daemonState
	Reg       *prometheus.Registry
	Handing   bool
}

func (in *instance) view() instanceView {
	in.mu.Lock()
	defer in.mu.Unlock()
	v := instanceView{Role: in.role, Since: in.since, Detail: in.detail, State: in.state, Reg: in.reg, Handing: in.handing}
	if in.state != nil && in.state.takenOver != nil {
		v.TakenOver = in.state.takenOver()
	}
	return v
}

func (in *instance) set(role, detail string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.role != role {
		in.since = time.Now()
	}
	in.role, in.detail, in.state, in.reg, in.handing = role, detail, nil, in.base, false
}

// handingOver records whether the serving daemon is handing the directory over.
func (in *instance) handingOver(on bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.handing = on
}

// serve makes the instance report a serving daemon.
func (in *instance) serve(st *daemonState, reg *prometheus.Registry, detail string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.role, in.since, in.detail, in.state, in.reg = roleServing, time.Now(), detail, st, reg
}
