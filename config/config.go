// Package config reads the multireg drivers file: the types a user writes, strict parsing,
// validation that reports every problem with its field path and value, defaults folded into
// every driver, and a pure Diff between two configurations.
//
// Consumers only ever see a resolved RegistrarConfig: every Driver carries its final socket
// path, versions, backoff policy and timeouts, so no other package applies a default.
package config

import (
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"
)

// File format identity. Any other apiVersion or kind is rejected.
const (
	APIVersion = "multireg.dev/v1alpha1"
	Kind       = "RegistrarConfig"
)

// Plugin types, as kubelet's pluginregistration/v1 API spells them.
const (
	CSIPlugin    = "CSIPlugin"
	DRAPlugin    = "DRAPlugin"
	DevicePlugin = "DevicePlugin"
)

// Types lists the plugin types in the order they are reported.
var Types = []string{CSIPlugin, DRAPlugin, DevicePlugin}

const (
	// DefaultRegistrationDir is kubelet's default plugins-registry directory.
	DefaultRegistrationDir = "/var/lib/kubelet/plugins_registry"

	// MaxFileSize is the largest drivers file accepted, in bytes.
	MaxFileSize = 1 << 20

	// MaxSocketPathLen is the longest unix socket path Linux can bind or dial: sun_path is
	// 108 bytes including the terminating NUL. A longer path fails late with a cryptic
	// "bind: invalid argument".
	MaxSocketPathLen = 107

	// TempSocketNameLen is the length of the hidden temporary name a registration socket is
	// created under before it is renamed onto its final name (".mr-<8 hex>.tmp"). The
	// registration directory must leave room for it.
	TempSocketNameLen = len(".mr-00000000.tmp")
)

// Built-in defaults, used where neither the driver nor the file's defaults set a value.
const (
	// DefaultInitialInterval: a first retry 400–600 ms after a failure (with the default
	// randomization) reaches kubelet before its next reconcile pass, which runs every second:
	// one failure costs one pass. A 1 s default lands 0.8–1.2 s later and misses that pass
	// half the time.
	DefaultInitialInterval     = 500 * time.Millisecond
	DefaultMaxInterval         = 2 * time.Minute
	DefaultMultiplier          = 2.0
	DefaultRandomizationFactor = 0.2
	DefaultRegistrationTimeout = 2 * time.Minute
	// DefaultHealthTimeout bounds a liveness check of a driver (GET /healthz/<driver>):
	// kubernetes-csi/livenessprobe's --probe-timeout default since v2.17.
	DefaultHealthTimeout   = 3 * time.Second
	DefaultWaitForEndpoint = true

	// MinInterval is the shortest backoff interval accepted: shorter ones retry in a busy loop.
	MinInterval = 10 * time.Millisecond
)

// HealthServices are the DRAResourceHealth gRPC services kubelet knows, newest first, as
// kubelet names them in a DRA driver's supportedVersions. kubelet (1.37 and later) calls the
// first one the driver lists.
var HealthServices = []string{"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}

// DetectsHealth reports whether the loop asks the driver's endpoint which DRAResourceHealth
// services (HealthServices) it serves, and advertises those after SupportedVersions: a DRA
// driver that multireg probes (WaitForEndpoint) and whose supportedVersions name none.
// kubelet 1.37 and later watch a DRA driver's device health only when it lists one, and stop
// for good at the first Unimplemented answer; older kubelets ignore the names.
func (d Driver) DetectsHealth() bool {
	return d.Type == DRAPlugin && d.WaitForEndpoint &&
		!slices.ContainsFunc(d.SupportedVersions, func(v string) bool { return slices.Contains(HealthServices, v) })
}

// DefaultVersions returns the supportedVersions advertised for a type when a driver sets none.
func DefaultVersions(typ string) []string {
	switch typ {
	case CSIPlugin:
		return []string{"1.0.0"}
	case DRAPlugin:
		return []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}
	case DevicePlugin:
		return []string{"v1beta1"}
	}
	return nil
}

// RegistrarConfig is one resolved, valid drivers file.
type RegistrarConfig struct {
	// RegistrationDir is kubelet's plugins-registry directory as this process sees it.
	RegistrationDir string
	// Drivers are in file order, each fully resolved.
	Drivers []Driver
}

// Driver is one plugin to register, with every default applied.
//
// Its fields come in four groups, and each field is in exactly one. The group says what a
// change of the field does, and everything that compares, copies or carries a driver reads it
// from here: a reload's Diff, the hand-over's RegistersAs and its wire, the loop taking a new
// policy, the status, and the tests.
//   - Registration: what kubelet sees of the driver, its GetInfo answer and the paths of its
//     registration sockets. A change registers the driver anew.
//   - Local: where this process reaches what kubelet reaches by its own path. kubelet sees
//     nothing of it: the running loop goes on with its sockets, and reaches the driver there.
//   - Policy: how the loop paces its attempts, and whether the driver's absence fails
//     readiness. The running loop takes a change; kubelet sees nothing.
//   - Display: what status shows, and nothing else reads.
type Driver struct {
	Registration
	Local
	Policy
	Display
}

// Registration is what kubelet sees of a driver: a change of any of it registers the driver
// anew (Diff's Changed), and a hand-over keeps a driver's sockets only when it is unchanged
// (the hand-over's RegistersAs).
type Registration struct {
	// Name is the plugin name kubelet sees.
	Name string
	// Type is CSIPlugin, DRAPlugin or DevicePlugin.
	Type string
	// Endpoint is the path kubelet dials to reach the plugin (a host path). Its last element
	// may be a pattern (EndpointIsPattern): kubelet is then given the matching socket's path.
	Endpoint string
	// SupportedVersions are advertised to kubelet in GetInfo.
	SupportedVersions []string
	// SocketName is the registration socket's file name in the registration directory.
	SocketName string
	// SocketPath is RegistrationDir joined with SocketName.
	SocketPath string
	// AltSocketPath is the second registration socket of a driver that rolls its
	// registration over from one endpoint instance to the next (RollsOver), and of a DRA
	// driver, registered again in the path kubelet does not hold; "" for the others
	// (SetSocketPaths). It follows from SocketName, the type and the endpoint.
	AltSocketPath string
	// SparePath is the third registration socket of a device plugin whose endpoint is a
	// pattern (SpareSocketName; "" for the others): where its instance is registered when
	// kubelet may still hold both others (a move's drop repaired while kubelet deregisters the
	// old instance), so that kubelet registers it in the next reconcile pass.
	SparePath string
}

// Local is where this process reaches what kubelet reaches by its own path: kubelet sees
// nothing of it. A change moves the running loop there with its sockets (the Supervisor's
// Update); a hand-over keeps the sockets whatever it says.
type Local struct {
	// LocalEndpoint is the driver's endpoint as this process sees it; it equals Endpoint
	// unless set.
	LocalEndpoint string
}

// Policy is how a driver's loop paces its attempts, and whether the driver's absence fails
// readiness: none of it reaches kubelet. A running loop takes a change, a hand-over's
// receiver runs its own.
type Policy struct {
	// Backoff paces retries after a failure.
	Backoff Backoff
	// RegistrationTimeout is how long to wait for kubelet's verdict after the socket
	// appears before recreating it; zero disables the timeout.
	RegistrationTimeout time.Duration
	// WaitForEndpoint publishes the socket only while LocalEndpoint accepts connections.
	WaitForEndpoint bool
	// Required makes the driver's absence from this node (no file at LocalEndpoint) fail
	// readiness. A driver that is not required may be absent: a fleet's nodes run different
	// drivers from one drivers file.
	Required bool
	// HealthTimeout bounds a liveness check of the driver (package health): a driver that
	// does not answer within it is not alive.
	HealthTimeout time.Duration
}

// Display is what status shows of a driver, and nothing else reads: the loop and kubelet see
// none of it. It has no field yet. A field added here (with the json tag /status shows it
// under: the status carries the group whole) is read from the drivers file in file.go, and
// admitted by the chart's values.schema.json; multireg status -o json shows it, and its table
// only if cmd/multireg/status.go gives it a column. A reload updates it in place, and a
// hand-over's receiver shows its own.
type Display struct{}

// Backoff is an exponential backoff policy. Retries never stop; a success resets it.
type Backoff struct {
	InitialInterval     time.Duration
	MaxInterval         time.Duration
	Multiplier          float64
	RandomizationFactor float64
}

// Change is what differs between two configurations of one driver, by group (Driver).
type Change uint8

const (
	ChangeRegistration Change = 1 << iota // kubelet would see it: the driver is registered anew
	ChangeLocal                           // where this process reaches the endpoint
	ChangePolicy                          // the loop's pace, or readiness
	ChangeDisplay                         // what status shows
)

// Changes reports which groups of fields differ between d and o.
func (d Driver) Changes(o Driver) Change {
	var c Change
	for _, g := range []struct {
		bit  Change
		a, b any
	}{
		{ChangeRegistration, d.Registration, o.Registration},
		{ChangeLocal, d.Local, o.Local},
		{ChangePolicy, d.Policy, o.Policy},
		{ChangeDisplay, d.Display, o.Display},
	} {
		if !reflect.DeepEqual(g.a, g.b) {
			c |= g.bit
		}
	}
	return c
}

// Equal reports whether two resolved drivers are the same in every field.
func (d Driver) Equal(o Driver) bool { return d.Changes(o) == 0 }

// Equal reports whether two drivers register the same way with kubelet.
func (r Registration) Equal(o Registration) bool { return reflect.DeepEqual(r, o) }

// Summary describes the configuration in one line, e.g.
// "4 drivers (2 CSIPlugin, 1 DRAPlugin, 1 DevicePlugin) in /var/lib/kubelet/plugins_registry".
func (c *RegistrarConfig) Summary() string {
	counts := map[string]int{}
	for _, d := range c.Drivers {
		counts[d.Type]++
	}
	var parts []string
	for _, t := range Types {
		if counts[t] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", counts[t], t))
		}
	}
	s := fmt.Sprintf("%d drivers", len(c.Drivers))
	if len(c.Drivers) == 1 {
		s = "1 driver"
	}
	if len(parts) > 0 {
		s += " (" + strings.Join(parts, ", ") + ")"
	}
	return s + " in " + c.RegistrationDir
}

// SetSocketPaths sets the driver's registration socket paths in the registration directory
// dir from its SocketName, type and endpoint: SocketPath; AltSocketPath for a driver that
// rolls its registration over from one endpoint instance to the next (RollsOver), and for a
// DRA driver whose endpoint is fixed when it fits (MaxSocketPathLen): registered again, it
// goes to the path kubelet does not hold, which kubelet registers in the pass that deregisters
// the old one; SparePath for a device plugin whose endpoint is a pattern.
func (d *Driver) SetSocketPaths(dir string) {
	d.SocketPath = filepath.Join(dir, d.SocketName)
	d.AltSocketPath, d.SparePath = "", ""
	alt := filepath.Join(dir, AltSocketName(d.SocketName))
	switch {
	case d.RollsOver():
		d.AltSocketPath = alt
		if d.Type == DevicePlugin {
			d.SparePath = filepath.Join(dir, SpareSocketName(d.SocketName))
		}
	case d.Type == DRAPlugin && len(alt) <= MaxSocketPathLen:
		d.AltSocketPath = alt
	}
}

// SocketPaths are the driver's registration socket paths: SocketPath, then AltSocketPath and
// SparePath when it has them.
func (d Driver) SocketPaths() []string {
	paths := []string{d.SocketPath}
	for _, p := range []string{d.AltSocketPath, d.SparePath} {
		if p != "" {
			paths = append(paths, p)
		}
	}
	return paths
}

// SocketNames are the file names of the driver's registration sockets in the registration
// directory: SocketName, and the second and third ones of a driver that has them.
func (d Driver) SocketNames() []string {
	paths := d.SocketPaths()
	for i, p := range paths {
		paths[i] = filepath.Base(p)
	}
	return paths
}

// DefaultSocketName is the registration socket name used when a driver sets none:
// "<name>-reg.sock", with every character other than letters, digits, '.', '_' and '-'
// replaced by '_' (a device plugin's "vendor.example/gpu" becomes "vendor.example_gpu-reg.sock").
func DefaultSocketName(name string) string {
	safe := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-':
			return r
		}
		return '_'
	}, name)
	return safe + "-reg.sock"
}
