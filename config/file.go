package config

import (
	"time"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// The types below are the file format, and the functions after them read each type from its
// YAML node. A pointer or slice left nil is a field the file leaves out, so that resolve can
// tell it from an explicit value.

type file struct {
	APIVersion      string
	Kind            string
	RegistrationDir string
	Defaults        settings
	Drivers         []driverSpec
}

// settings are the fields that defaults sets for every driver and a driver sets for itself.
type settings struct {
	Backoff             backoffSpec
	RegistrationTimeout *time.Duration
	WaitForEndpoint     *bool
}

type backoffSpec struct {
	InitialInterval     *time.Duration
	MaxInterval         *time.Duration
	Multiplier          *float64
	RandomizationFactor *float64
}

type driverSpec struct {
	Name              string
	Type              string
	Endpoint          string
	LocalEndpoint     string
	SupportedVersions []string
	SocketName        string
	settings
}

// The fields of each mapping, as the file names them. topFields is also the order in which
// errors are reported.
var (
	topFields      = []string{"apiVersion", "kind", "registrationDir", "defaults", "drivers"}
	settingsFields = []string{"backoff", "registrationTimeout", "waitForEndpoint"}
	backoffFields  = []string{"initialInterval", "maxInterval", "multiplier", "randomizationFactor"}
	driverFields   = append([]string{"name", "type", "endpoint", "localEndpoint", "supportedVersions", "socketName"}, settingsFields...)
)

func (d *decoder) file(n *yaml.Node) *file {
	var f file
	d.mapping(n, nil, topFields, func(k string, v *yaml.Node, p *field.Path) {
		switch k {
		case "apiVersion":
			f.APIVersion = d.str(v, p)
		case "kind":
			f.Kind = d.str(v, p)
		case "registrationDir":
			f.RegistrationDir = d.str(v, p)
		case "defaults":
			d.mapping(v, p, settingsFields, func(k string, v *yaml.Node, p *field.Path) { d.setting(&f.Defaults, k, v, p) })
		case "drivers":
			f.Drivers = list(d, v, p, d.driver)
		}
	})
	return &f
}

func (d *decoder) driver(n *yaml.Node, p *field.Path) driverSpec {
	var s driverSpec
	d.mapping(n, p, driverFields, func(k string, v *yaml.Node, p *field.Path) {
		switch k {
		case "name":
			s.Name = d.str(v, p)
		case "type":
			s.Type = d.str(v, p)
		case "endpoint":
			s.Endpoint = d.str(v, p)
		case "localEndpoint":
			s.LocalEndpoint = d.str(v, p)
		case "supportedVersions":
			s.SupportedVersions = list(d, v, p, d.str)
		case "socketName":
			s.SocketName = d.str(v, p)
		default:
			d.setting(&s.settings, k, v, p)
		}
	})
	return s
}

func (d *decoder) setting(s *settings, k string, v *yaml.Node, p *field.Path) {
	switch k {
	case "backoff":
		d.mapping(v, p, backoffFields, func(k string, v *yaml.Node, p *field.Path) {
			switch k {
			case "initialInterval":
				s.Backoff.InitialInterval = d.duration(v, p)
			case "maxInterval":
				s.Backoff.MaxInterval = d.duration(v, p)
			case "multiplier":
				s.Backoff.Multiplier = d.number(v, p)
			case "randomizationFactor":
				s.Backoff.RandomizationFactor = d.number(v, p)
			}
		})
	case "registrationTimeout":
		s.RegistrationTimeout = d.duration(v, p)
	case "waitForEndpoint":
		s.WaitForEndpoint = d.boolean(v, p)
	}
}
