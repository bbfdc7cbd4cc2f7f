package config

import (
	"fmt"
	"time"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// file is a drivers file as written. Each driver is read into a Driver over the file's
// defaults, themselves read over builtin; a setting is checked where it is written. resolve
// then checks the rest of each driver and fills in what it leaves out (an empty string, a
// nil list).
type file struct {
	APIVersion      string
	Kind            string
	RegistrationDir string
	Drivers         []Driver // nil when the file leaves drivers out
}

// builtin holds the settings neither the driver nor the file's defaults set: the defaults of
// a driver's Policy, the one group that defaults may set.
var builtin = Policy{
	Backoff: Backoff{
		InitialInterval:     DefaultInitialInterval,
		MaxInterval:         DefaultMaxInterval,
		Multiplier:          DefaultMultiplier,
		RandomizationFactor: DefaultRandomizationFactor,
	},
	RegistrationTimeout: DefaultRegistrationTimeout,
	WaitForEndpoint:     DefaultWaitForEndpoint,
	HealthTimeout:       DefaultHealthTimeout,
}

// The fields of each mapping, as the file names them. topFields is also the order in which
// errors are reported.
var (
	topFields = []string{"apiVersion", "kind", "registrationDir", "defaults", "drivers"}
	// settingsFields are a driver's Policy: what defaults may set for every driver.
	settingsFields = []string{"backoff", "registrationTimeout", "waitForEndpoint", "required", "healthTimeout"}
	backoffFields  = []string{"initialInterval", "maxInterval", "multiplier", "randomizationFactor"}
	driverFields   = append([]string{"name", "type", "endpoint", "localEndpoint", "supportedVersions", "socketName"}, settingsFields...)
)

func (d *decoder) file(n *yaml.Node) *file {
	var f file
	defaults := builtin
	var drivers *yaml.Node // read once the defaults are known, wherever they are written
	d.mapping(n, nil, topFields, func(k string, v *yaml.Node, p *field.Path) {
		switch k {
		case "apiVersion":
			f.APIVersion = d.str(v, p)
		case "kind":
			f.Kind = d.str(v, p)
		case "registrationDir":
			f.RegistrationDir = d.str(v, p)
		case "defaults":
			d.mapping(v, p, settingsFields, func(k string, v *yaml.Node, p *field.Path) { d.setting(&defaults, k, v, p) })
		case "drivers":
			drivers = v
		}
	})
	if drivers != nil {
		f.Drivers = list(d, drivers, field.NewPath("drivers"), Driver{Policy: defaults}, func(n *yaml.Node, p *field.Path) Driver {
			return d.driver(n, p, defaults)
		})
	}
	return &f
}

func (d *decoder) driver(n *yaml.Node, p *field.Path, defaults Policy) Driver {
	dr := Driver{Policy: defaults}
	d.mapping(n, p, driverFields, func(k string, v *yaml.Node, p *field.Path) {
		switch k {
		case "name":
			dr.Name = d.str(v, p)
		case "type":
			dr.Type = d.str(v, p)
		case "endpoint":
			dr.Endpoint = d.str(v, p)
		case "localEndpoint":
			dr.LocalEndpoint = d.str(v, p)
		case "supportedVersions":
			dr.SupportedVersions = list(d, v, p, "", d.str)
		case "socketName":
			dr.SocketName = d.str(v, p)
		default:
			d.setting(&dr.Policy, k, v, p)
		}
	})
	return dr
}

// setting reads one of the settings that defaults sets for every driver and a driver sets
// for itself (its Policy) over the value dr holds, and checks it.
func (d *decoder) setting(dr *Policy, k string, v *yaml.Node, p *field.Path) {
	switch k {
	case "backoff":
		d.backoff(&dr.Backoff, v, p)
	case "registrationTimeout":
		t, ok := d.duration(v, p)
		switch {
		case !ok:
			return
		case t < 0:
			d.invalid(p, t, "must not be negative (0 disables the timeout)")
		case t > 0 && t < time.Second:
			d.invalid(p, t, "must be 0 (disabled) or at least 1s: kubelet looks for new sockets once a second")
		}
		dr.RegistrationTimeout = t
	case "waitForEndpoint":
		if w, ok := d.boolean(v, p); ok {
			dr.WaitForEndpoint = w
		}
	case "required":
		if r, ok := d.boolean(v, p); ok {
			dr.Required = r
		}
	case "healthTimeout":
		t, ok := d.duration(v, p)
		switch {
		case !ok:
			return
		case t < 100*time.Millisecond || t > time.Minute:
			d.invalid(p, t, "must be from 100ms to 1m: a liveness check's bound")
		}
		dr.HealthTimeout = t
	}
}

// backoff reads the fields of a backoff mapping over b, and checks each.
func (d *decoder) backoff(b *Backoff, n *yaml.Node, p *field.Path) {
	intervalSet := false
	d.mapping(n, p, backoffFields, func(k string, v *yaml.Node, p *field.Path) {
		switch k {
		case "initialInterval", "maxInterval":
			t, ok := d.duration(v, p)
			switch {
			case !ok:
				return
			case t <= 0:
				d.invalid(p, t, "must be positive")
			case t < MinInterval:
				// Shorter retries would spin a core.
				d.invalid(p, t, "must be at least "+MinInterval.String())
			}
			intervalSet = true
			if k == "initialInterval" {
				b.InitialInterval = t
			} else {
				b.MaxInterval = t
			}
		case "multiplier":
			if f, ok := d.number(v, p); ok {
				if b.Multiplier = f; f < 1 {
					d.invalid(p, f, "must be at least 1")
				}
			}
		case "randomizationFactor":
			if f, ok := d.number(v, p); ok {
				if b.RandomizationFactor = f; f < 0 || f > 1 {
					d.invalid(p, f, "must be between 0 and 1")
				}
			}
		}
	})
	if intervalSet && b.InitialInterval > 0 && b.MaxInterval > 0 && b.MaxInterval < b.InitialInterval {
		d.invalid(p.Child("maxInterval"), b.MaxInterval, fmt.Sprintf("must not be less than initialInterval (%s)", b.InitialInterval))
	}
}
