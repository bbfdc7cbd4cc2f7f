package nodecond

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Reasons of the condition (CamelCase, as a condition's reason is).
const (
	// ReasonRegistered: kubelet holds every required plugin, as its own records say.
	ReasonRegistered = "RequiredPluginsRegistered"
	// ReasonMissing: kubelet does not hold some required plugin; the message names each.
	ReasonMissing = "RequiredPluginsMissing"
	// ReasonNoneRequired: no driver of the drivers file is required.
	ReasonNoneRequired = "NoRequiredPlugins"
)

// CSINode is what the node's CSINode object (kubelet's record of the CSI drivers it
// registered) says, as last read.
type CSINode struct {
	// Known: the object has been read (it may not exist: kubelet creates it at start).
	Known bool
	// Drivers are the drivers it lists, and since when this process has seen each listed.
	Drivers map[string]time.Time
}

// Driver is what a driver's loop says of it that the condition reads (registrar.DriverStatus,
// as multireg's daemon passes it on).
type Driver struct {
	Name     string `json:"name"`
	Type     string `json:"type"`
	Required bool   `json:"required"`
	// Phase is the loop's: WaitingForEndpoint, Serving, Registered or BackingOff; Since, since
	// when.
	Phase string    `json:"phase"`
	Since time.Time `json:"since"`
	// Absent: no file at the endpoint's path; EndpointUp and EndpointSince: whether the
	// endpoint answered at the last look, and since when.
	Absent        bool      `json:"absent,omitempty"`
	EndpointUp    bool      `json:"endpointUp,omitempty"`
	EndpointSince time.Time `json:"endpointSince,omitzero"`
	// LastError is why the loop last backed off or waits (kubelet's words for a rejection).
	LastError string `json:"lastError,omitempty"`
	// Devices is what kubelet's pod-resources API holds of a device plugin's resource; nil
	// when it does not say (another type, or the API not read or not answering).
	Devices *int `json:"devices,omitempty"`
}

// The phases of a driver's loop (registrar.Phase), and the types of driver.
const (
	phaseWaiting    = "WaitingForEndpoint"
	phaseServing    = "Serving"
	phaseRegistered = "Registered"
	phaseBackingOff = "BackingOff"

	typeCSI    = "CSIPlugin"
	typeDevice = "DevicePlugin"
)

// Input is what the condition is decided from: each driver's loop (kubelet's verdict), the
// node's CSINode, and whether kubelet's pod-resources API is read (PodResources) and answers.
type Input struct {
	Drivers      []Driver `json:"drivers"`
	CSINode      CSINode  `json:"-"`
	PodResources bool     `json:"podResources"` // the instance reads kubelet's pod-resources API
	Answers      bool     `json:"answers"`      // and it answers
	// Now is when the input was taken: the time a CSI driver has waited for CSINode is
	// measured from its registration to Now.
	Now time.Time `json:"-"`
}

// Evidence is whether kubelet holds one driver, as its own records say, and if not, why.
type Evidence struct {
	Driver   string
	Type     string
	Required bool
	Held     bool
	Why      string // empty when held
	// NotListed: a CSI driver kubelet accepted that CSINode has not listed for longer than
	// CSINodeGrace (a warning).
	NotListed bool
}

// CSINodeGrace is how long a CSI driver kubelet accepted may be missing from CSINode before
// that is a warning: two of kubelet's reconcile passes. kubelet writes CSINode while it
// registers the driver, before its verdict; a driver still missing after two passes is one
// kubelet accepted and CSINode does not show.
const CSINodeGrace = 2 * time.Second

// Verdict is the condition's value: True when every required driver is held, and the
// evidence for each driver.
type Verdict struct {
	True     bool
	Reason   string
	Message  string
	Evidence []Evidence // sorted by driver name
}

// maxWhy bounds what the message says of one driver; maxMessage the whole message. A node
// object is read by every client of the node: a condition's message stays short.
const (
	maxWhy     = 300
	maxMessage = 1024
)

// kubeletsPrefix is what kubelet's operation executor puts before every handler's error in
// its verdict (pkg/kubelet/pluginmanager/operationexecutor): the handler's words after it
// are what the message keeps.
const kubeletsPrefix = "RegisterPlugin error -- plugin registration failed with err: "

// Evaluate decides the condition from in. A required driver counts when kubelet registered it
// (its verdict) and, for a CSI driver, the node's CSINode lists it; for a device plugin,
// kubelet's pod-resources API holds devices of its resource (when the instance reads that
// API); for a DRA driver, the verdict alone. Drivers that are not required have their
// evidence too, but never decide.
func Evaluate(in Input) Verdict {
	var v Verdict
	required, held := 0, 0
	var missing []Evidence
	for _, d := range in.Drivers {
		e := evidence(d, in)
		v.Evidence = append(v.Evidence, e)
		if !d.Required {
			continue
		}
		required++
		if e.Held {
			held++
		} else {
			missing = append(missing, e)
		}
	}
	slices.SortFunc(v.Evidence, func(a, b Evidence) int { return strings.Compare(a.Driver, b.Driver) })
	slices.SortFunc(missing, func(a, b Evidence) int { return strings.Compare(a.Driver, b.Driver) })
	switch {
	case required == 0:
		v.True, v.Reason = true, ReasonNoneRequired
		v.Message = "no driver of multireg's drivers file is required"
	case len(missing) == 0:
		v.True, v.Reason = true, ReasonRegistered
		v.Message = fmt.Sprintf("kubelet holds every required plugin (%d)", required)
	default:
		v.Reason = ReasonMissing
		v.Message = missingMessage(missing, required)
	}
	return v
}

// missingMessage names each missing driver and why, within maxMessage: those that do not fit
// are counted.
func missingMessage(missing []Evidence, required int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d required plugins not held by kubelet:", len(missing), required)
	for i, e := range missing {
		part := fmt.Sprintf(" %s (%s): %s;", e.Driver, e.Type, cut(e.Why, maxWhy))
		rest := len(missing) - i
		more := fmt.Sprintf(" and %d more", rest)
		if b.Len()+len(part) > maxMessage-len(more) {
			b.WriteString(more)
			return b.String()
		}
		b.WriteString(part)
	}
	return strings.TrimSuffix(b.String(), ";")
}

// cut shortens s to at most n bytes, on a rune boundary, marking the cut.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n - len("…")
	for i > 0 && !isRuneStart(s[i]) {
		i--
	}
	return s[:i] + "…"
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// stamp is how the message says a time: to the second, UTC, so that a message changes only
// when what it says does (never with the time it is written).
func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// evidence is whether kubelet holds d, as its own records say.
func evidence(d Driver, in Input) Evidence {
	e := Evidence{Driver: d.Name, Type: d.Type, Required: d.Required}
	switch d.Phase {
	case phaseWaiting:
		if d.Absent {
			e.Why = "no endpoint on this node since " + stamp(d.Since)
		} else {
			e.Why = "endpoint not ready since " + stamp(d.Since)
			if d.LastError != "" {
				e.Why += ": " + d.LastError
			}
		}
		return e
	case phaseServing, phaseBackingOff:
		// A driver that kubelet refused, or never answered, retries: between two attempts it
		// serves a new socket and backs off again. The message says why it failed, the same
		// each attempt while kubelet says the same, not when each attempt began.
		switch {
		case d.LastError != "":
			e.Why = "not registered: " + strings.Replace(d.LastError, kubeletsPrefix, "", 1)
		case d.Phase == phaseServing:
			e.Why = "waiting for kubelet's verdict since " + stamp(d.Since)
		default:
			e.Why = "not registered since " + stamp(d.Since)
		}
		return e
	case phaseRegistered:
		if d.Absent {
			// kubelet keeps the registration of a driver whose endpoint's socket went (it
			// would take the driver back at once): it serves nothing until it is back.
			e.Why = "registered, and its endpoint is gone"
			if !d.EndpointUp && !d.EndpointSince.IsZero() {
				e.Why += " since " + stamp(d.EndpointSince)
			}
			return e
		}
	default:
		e.Why = "phase " + d.Phase
		return e
	}
	switch d.Type {
	case typeCSI:
		switch _, listed := in.CSINode.Drivers[d.Name]; {
		case !in.CSINode.Known:
			e.Why = "registered; the node's CSINode not read yet"
		case !listed:
			e.Why = "registered since " + stamp(d.Since) + ", not listed in the node's CSINode"
			e.NotListed = in.Now.Sub(d.Since) > CSINodeGrace
		default:
			e.Held = true
		}
	case typeDevice:
		switch {
		case !in.PodResources:
			e.Held = true // kubelet's verdict is all there is to read
		case !in.Answers:
			e.Why = "registered; kubelet's pod-resources API does not answer"
		case d.Devices == nil || *d.Devices == 0:
			e.Why = "registered, and kubelet holds no allocatable device of its resource"
		default:
			e.Held = true
		}
	default:
		e.Held = true
	}
	return e
}
