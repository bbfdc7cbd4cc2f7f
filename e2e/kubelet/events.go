package kubelet

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// EventKind says which handler call an Event records and how it ended.
type EventKind string

// The handler calls, as kubelet makes them.
const (
	EventValidate       EventKind = "Validate"       // ValidatePlugin accepted the plugin
	EventValidateFailed EventKind = "ValidateFailed" // ValidatePlugin refused it; kubelet retries with backoff
	EventRegister       EventKind = "Register"       // RegisterPlugin succeeded: the plugin is registered
	EventRegisterFailed EventKind = "RegisterFailed" // RegisterPlugin failed
	EventDeRegister     EventKind = "DeRegister"     // DeRegisterPlugin: socket removed or recreated
)

// Event is one handler call.
type Event struct {
	Kind     EventKind
	Type     string // CSIPlugin, DRAPlugin or DevicePlugin
	Name     string
	Endpoint string
	Versions []string // nil for DeRegister
	Err      string   // why a *Failed call failed
	Time     time.Time
}

func (e Event) String() string {
	s := fmt.Sprintf("%s %s %s %q endpoint=%s versions=%v",
		e.Time.Format("15:04:05.000"), e.Kind, e.Type, e.Name, e.Endpoint, e.Versions)
	if e.Err != "" {
		s += " err=" + e.Err
	}
	return s
}

// Counts are the handler calls for one name.
type Counts struct {
	Validations, ValidationFailures     int
	Registrations, RegistrationFailures int
	Deregistrations                     int
}

func pick(err error, ok, failed EventKind) EventKind {
	if err != nil {
		return failed
	}
	return ok
}

func (k *Kubelet) record(kind EventKind, typ, name, endpoint string, versions []string, err error) {
	e := Event{Kind: kind, Type: typ, Name: name, Endpoint: endpoint, Versions: slices.Clone(versions), Time: time.Now()}
	if err != nil {
		e.Err = err.Error()
	}
	k.mu.Lock()
	k.events = append(k.events, e)
	k.mu.Unlock()
	attrs := []any{"event", kind, "type", typ, "name", name, "endpoint", endpoint}
	if versions != nil {
		attrs = append(attrs, "versions", versions)
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	k.log.Info("kubelet handler", attrs...)
}

// Registered reports whether a plugin of that name is registered with its handler: its last
// RegisterPlugin succeeded and no DeRegisterPlugin has removed it since.
func (k *Kubelet) Registered(name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if d, ok := k.csi[name]; ok && d.registered {
		return true
	}
	return len(k.devices[name]) > 0 || len(k.dra[name]) > 0
}

// RegisteredNames returns the names of all registered plugins, sorted.
func (k *Kubelet) RegisteredNames() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var names []string
	for n, d := range k.csi {
		if d.registered {
			names = append(names, n)
		}
	}
	for n := range k.devices {
		names = append(names, n)
	}
	for n := range k.dra {
		names = append(names, n)
	}
	sort.Strings(names)
	return slices.Compact(names)
}

// RegisteredEndpoints returns the endpoints registered for name: one for a CSI driver, one for
// a device plugin on kubelet 1.36 and older (one per endpoint from 1.37, see
// [DevicePluginsKeyedByEndpoint]), one per instance for a DRA driver.
func (k *Kubelet) RegisteredEndpoints(name string) []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var eps []string
	if d, ok := k.csi[name]; ok && d.registered {
		eps = append(eps, d.endpoint)
	}
	eps = append(eps, k.devices[name]...)
	return append(eps, k.dra[name]...)
}

// Events returns every handler call so far, oldest first.
func (k *Kubelet) Events() []Event {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.events)
}

// EventsFor returns the handler calls for name, oldest first.
func (k *Kubelet) EventsFor(name string) []Event {
	k.mu.Lock()
	defer k.mu.Unlock()
	var es []Event
	for _, e := range k.events {
		if e.Name == name {
			es = append(es, e)
		}
	}
	return es
}

// Counts counts the handler calls for name.
func (k *Kubelet) Counts(name string) Counts {
	var c Counts
	for _, e := range k.EventsFor(name) {
		switch e.Kind {
		case EventValidate:
			c.Validations++
		case EventValidateFailed:
			c.ValidationFailures++
		case EventRegister:
			c.Registrations++
		case EventRegisterFailed:
			c.RegistrationFailures++
		case EventDeRegister:
			c.Deregistrations++
		}
	}
	return c
}

// FormatEvents renders events one per line, for test failure messages.
func FormatEvents(es []Event) string {
	var b strings.Builder
	for _, e := range es {
		b.WriteString("\n\t")
		b.WriteString(e.String())
	}
	return b.String()
}
