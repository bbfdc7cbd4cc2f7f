//go:build linux

package main

import (
	"sync"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/health"
	"multireg.dev/multireg/registrar"
)

// healthTargets says what a check of each driver dials: the running loop's target when this
// process serves the directory (a pattern's match), else what the drivers file says (a
// pattern's newest matching socket), so that a standby instance answers checks alike.
type healthTargets struct {
	mu  sync.Mutex
	cfg *config.RegistrarConfig
	sup *registrar.Supervisor // nil while no round serves
}

func (t *healthTargets) set(cfg *config.RegistrarConfig, sup *registrar.Supervisor) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if cfg != nil {
		t.cfg = cfg
	}
	t.sup = sup
}

// get is the target of the named driver (health.New's targets).
func (t *healthTargets) get(name string) (health.Target, bool) {
	t.mu.Lock()
	cfg, sup := t.cfg, t.sup
	t.mu.Unlock()
	if sup != nil {
		if typ, local, timeout, ok := sup.Target(name); ok && local != "" {
			return health.Target{Name: name, Type: typ, Path: local, Timeout: timeout}, true
		}
	}
	for _, d := range cfg.Drivers {
		if d.Name != name {
			continue
		}
		local := d.LocalEndpoint
		if d.EndpointIsPattern() {
			local = registrar.NewestMatch(d)
		}
		return health.Target{Name: name, Type: d.Type, Path: local, Timeout: d.HealthTimeout}, true
	}
	return health.Target{}, false
}
