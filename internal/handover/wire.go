package handover

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
)

// The wire format of a hand-over's messages: one encoder per protocol version, one decoder for
// every version, and the one place where the in-memory types (Msg, Driver, Socket,
// config.Driver, fsid.ID) become it and come back from it.
//
// Every type a message holds on the wire is one of this file's, each field with its key: no
// type of another package is encoded, so that a change elsewhere never changes what a peer
// reads.
//
// A message is written in its own version (Msg.Version, the one the two sides picked), its
// drivers by that version's encoder and never another's (Msg.MarshalJSON):
//   - version 1 (wireDriverV1): v0.1.0's layout, key for key. v0.1.0 encoded its config.Driver
//     and its loop's DriverStatus as they were (Go field names, no tags), and decodes a batch
//     into the same types: every key of the spec is always written, and the status also says
//     the driver's Name, Type, Endpoint and Required.
//   - version 2 (wireDriverV2): the status without Name, Type, Endpoint and Required (the
//     receiver's own configuration says them), and the spec without SupportedVersions when
//     there are none (the receiver's own then counts).
//
// Everything else (the envelope, a driver's keys besides the status, the spec's other keys,
// Backoff, a socket, a file's identity) is written alike by both; those types are shared.
//
// One decoder reads every version (Driver.UnmarshalJSON, into version 2's types): version 2's
// keys are all in version 1, and the receiver does not read the four keys of version 1's status
// that version 2 dropped. A field a peer does not send takes the receiver's own value (its
// configuration of the driver), never a zero that would make the loop behave otherwise: the
// spec's fields are pointers when read, nil when not sent.
//
// A released version's layout never changes: a change of what a message carries is a new
// protocol version (maxVersion) with its own encoder here, and a golden file of what this build
// writes in each version (testdata/HEAD/protocol-v<N>.json; version 1's also against
// testdata/v0.1.0, what v0.1.0 wrote: wire_test.go).

// wireMsg is a message on the wire, its drivers as D, the encoding of the message's version.
// Both versions have this envelope, and its keys are Msg's.
type wireMsg[D any] struct {
	Type       string `json:"type"`
	MinVersion int    `json:"minVersion,omitempty"`
	Version    int    `json:"version,omitempty"`
	Reason     string `json:"reason,omitempty"`
	Drivers    []D    `json:"drivers,omitempty"`
	Lock       bool   `json:"lock,omitempty"`
	Last       bool   `json:"last,omitempty"`
	Sockets    int    `json:"sockets,omitempty"`
	// Listeners: version 2 on.
	Listeners []ListenerSpec `json:"listeners,omitempty"`
}

// wireDriverV1 is a driver in a batch of version 1: v0.1.0's handedDriver.
type wireDriverV1 struct {
	Spec          wireSpecV1    `json:"spec"`
	Endpoint      string        `json:"endpoint"`
	LocalEndpoint string        `json:"localEndpoint"`
	EndpointID    wireID        `json:"endpointID"`
	NodeInfo      []byte        `json:"nodeInfo,omitempty"`
	Status        wireStatusV1  `json:"status"`
	Timeout       time.Duration `json:"timeout"`
	Failures      int           `json:"failures"`
	Sockets       []*wireSocket `json:"sockets,omitempty"`
}

// wireSpecV1 is the driver's configuration in version 1: v0.1.0's config.Driver, every key
// always written (SupportedVersions null when there are none).
type wireSpecV1 struct {
	Name                string        `json:"Name"`
	Type                string        `json:"Type"`
	Endpoint            string        `json:"Endpoint"`
	LocalEndpoint       string        `json:"LocalEndpoint"`
	SupportedVersions   []string      `json:"SupportedVersions"`
	SocketName          string        `json:"SocketName"`
	SocketPath          string        `json:"SocketPath"`
	AltSocketPath       string        `json:"AltSocketPath"`
	Backoff             wireBackoff   `json:"Backoff"`
	RegistrationTimeout time.Duration `json:"RegistrationTimeout"`
	WaitForEndpoint     bool          `json:"WaitForEndpoint"`
	Required            bool          `json:"Required"`
}

// wireStatusV1 is where the driver's loop stood, in version 1: v0.1.0's DriverStatus. Name,
// Type and Required are the spec's, Endpoint the driver's endpoint (the spec's until the loop
// has a target), as v0.1.0's status said them; Results and Recreations are {} when empty, as
// v0.1.0 always wrote them.
type wireStatusV1 struct {
	Name             string         `json:"Name"`
	Type             string         `json:"Type"`
	Phase            string         `json:"Phase"`
	Socket           string         `json:"Socket"`
	Endpoint         string         `json:"Endpoint"`
	EndpointUp       bool           `json:"EndpointUp"`
	Absent           bool           `json:"Absent"`
	Required         bool           `json:"Required"`
	Attempts         int            `json:"Attempts"`
	Failures         int            `json:"Failures"`
	Results          map[string]int `json:"Results"`
	Recreations      map[string]int `json:"Recreations"`
	EndpointRestarts int            `json:"EndpointRestarts"`
	HeldByOther      bool           `json:"HeldByOther"`
	LastError        string         `json:"LastError"`
	Since            time.Time      `json:"Since"`
	NextAttempt      time.Time      `json:"NextAttempt"`
}

// wireDriverV2 is a driver in a batch of version 2, and what the decoder reads a driver of any
// version into.
type wireDriverV2 struct {
	Spec          wireSpecV2   `json:"spec"`
	Endpoint      string       `json:"endpoint"`
	LocalEndpoint string       `json:"localEndpoint"`
	EndpointID    wireID       `json:"endpointID"`
	NodeInfo      []byte       `json:"nodeInfo,omitempty"`
	Status        wireStatusV2 `json:"status"`
	// Timeout is the registration timeout in force (nanoseconds); 0 or absent: the
	// receiver's own.
	Timeout  time.Duration `json:"timeout"`
	Failures int           `json:"failures"`
	Sockets  []*wireSocket `json:"sockets,omitempty"`
}

// wireSpecV2 is the driver's configuration as the sender ran it, in version 2 (every field
// written, but SupportedVersions when there are none); read from any version, a nil field was
// not sent.
type wireSpecV2 struct {
	Name                string         `json:"Name"`
	Type                *string        `json:"Type,omitempty"`
	Endpoint            *string        `json:"Endpoint,omitempty"`
	LocalEndpoint       *string        `json:"LocalEndpoint,omitempty"`
	SupportedVersions   []string       `json:"SupportedVersions,omitempty"`
	SocketName          *string        `json:"SocketName,omitempty"`
	SocketPath          *string        `json:"SocketPath,omitempty"`
	AltSocketPath       *string        `json:"AltSocketPath,omitempty"`
	Backoff             *wireBackoff   `json:"Backoff,omitempty"`
	RegistrationTimeout *time.Duration `json:"RegistrationTimeout,omitempty"`
	WaitForEndpoint     *bool          `json:"WaitForEndpoint,omitempty"`
	Required            *bool          `json:"Required,omitempty"`
}

// wireStatusV2 is where the driver's loop stood, in version 2: Status.
type wireStatusV2 struct {
	Phase            string         `json:"Phase"`
	Socket           string         `json:"Socket"`
	EndpointUp       bool           `json:"EndpointUp"`
	Absent           bool           `json:"Absent"`
	Attempts         int            `json:"Attempts"`
	Failures         int            `json:"Failures"`
	Results          map[string]int `json:"Results"`
	Recreations      map[string]int `json:"Recreations"`
	EndpointRestarts int            `json:"EndpointRestarts"`
	HeldByOther      bool           `json:"HeldByOther"`
	LastError        string         `json:"LastError"`
	Since            time.Time      `json:"Since"`
	NextAttempt      time.Time      `json:"NextAttempt"`
}

// wireBackoff is the driver's backoff policy (durations in nanoseconds), in both versions.
type wireBackoff struct {
	InitialInterval     time.Duration `json:"InitialInterval"`
	MaxInterval         time.Duration `json:"MaxInterval"`
	Multiplier          float64       `json:"Multiplier"`
	RandomizationFactor float64       `json:"RandomizationFactor"`
}

// wireSocket is one listening registration socket, in both versions; its descriptor travels
// beside the message.
type wireSocket struct {
	Prev          bool     `json:"prev,omitempty"`
	Path          string   `json:"path"`
	ID            wireID   `json:"id"`
	Generation    uint64   `json:"generation"`
	Registered    bool     `json:"registered"`
	AwaitsVerdict bool     `json:"awaitsVerdict,omitempty"`
	Endpoint      string   `json:"endpoint"`
	LocalEndpoint string   `json:"localEndpoint"`
	Versions      []string `json:"versions,omitempty"`
}

// wireID is a file's identity, in both versions: device, inode and change time, the change
// time in int64 seconds and nanoseconds (a Timespec's fields are 32-bit on linux/arm).
type wireID struct {
	Dev   uint64 `json:"dev"`
	Ino   uint64 `json:"ino"`
	CSec  int64  `json:"ctimeSec"`
	CNsec int64  `json:"ctimeNsec"`
}

// maxLastError bounds the last error a driver's status carries: a batch must fit one message.
const maxLastError = 4 << 10

// MarshalJSON encodes m in its version (Msg.Version), its drivers by that version's encoder. A
// message with drivers in a version this build does not write is an error; one without (a
// hello, which says a range, a refuse, an abort) has the envelope every version shares.
func (m Msg) MarshalJSON() ([]byte, error) {
	switch {
	case m.Version == 1 && len(m.Listeners) > 0:
		return nil, fmt.Errorf("listeners in hand-over version 1, which has none")
	case m.Version == 1:
		return json.Marshal(msgWire(&m, (*Driver).wireV1))
	case m.Version == 2:
		return json.Marshal(msgWire(&m, (*Driver).wireV2))
	case len(m.Drivers) > 0:
		return nil, fmt.Errorf("a %s of %d drivers in hand-over version %d, which this build does not write", m.Type, len(m.Drivers), m.Version)
	}
	return json.Marshal(msgWire(&m, (*Driver).wireV2))
}

// msgWire is m on the wire, its drivers encoded by enc.
func msgWire[D any](m *Msg, enc func(*Driver) D) *wireMsg[D] {
	w := &wireMsg[D]{Type: m.Type, MinVersion: m.MinVersion, Version: m.Version, Reason: m.Reason,
		Lock: m.Lock, Last: m.Last, Sockets: m.Sockets, Listeners: m.Listeners}
	for _, d := range m.Drivers {
		w.Drivers = append(w.Drivers, enc(d))
	}
	return w
}

// MarshalJSON encodes h alone as a batch of this build's newest version (maxVersion) carries
// it. A message encodes its drivers in its own version (Msg.MarshalJSON), never by this.
func (h *Driver) MarshalJSON() ([]byte, error) { return json.Marshal(h.wireV2()) }

// UnmarshalJSON decodes a batch's driver of any version. Its descriptors are not there: fill
// gives them.
func (h *Driver) UnmarshalJSON(b []byte) error {
	var w wireDriverV2
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	// Which keys of the spec were sent: a field of the registration that was not is the
	// receiver's own (RegistersAs).
	var keys struct {
		Spec map[string]json.RawMessage `json:"spec"`
	}
	if err := json.Unmarshal(b, &keys); err != nil {
		return err
	}
	*h = w.driver()
	h.unsent = unsentOf(keys.Spec)
	return nil
}

// wireV1 is h in a batch of version 1, as v0.1.0 wrote a driver.
func (h *Driver) wireV1() *wireDriverV1 {
	if h == nil {
		return nil
	}
	d, st := h.Spec, statusWire(h.Status)
	endpoint := h.Endpoint
	if endpoint == "" { // no target yet: v0.1.0's status showed the configured endpoint
		endpoint = d.Endpoint
	}
	return &wireDriverV1{
		Spec: wireSpecV1{
			Name:                d.Name,
			Type:                d.Type,
			Endpoint:            d.Endpoint,
			LocalEndpoint:       d.LocalEndpoint,
			SupportedVersions:   d.SupportedVersions,
			SocketName:          d.SocketName,
			SocketPath:          d.SocketPath,
			AltSocketPath:       altPathV1(d),
			Backoff:             backoffWire(d.Backoff),
			RegistrationTimeout: d.RegistrationTimeout,
			WaitForEndpoint:     d.WaitForEndpoint,
			Required:            d.Required,
		},
		Endpoint:      h.Endpoint,
		LocalEndpoint: h.LocalEndpoint,
		EndpointID:    idWire(h.EndpointID),
		NodeInfo:      h.NodeInfo,
		Status: wireStatusV1{
			Name:             d.Name,
			Type:             d.Type,
			Phase:            st.Phase,
			Socket:           st.Socket,
			Endpoint:         endpoint,
			EndpointUp:       st.EndpointUp,
			Absent:           st.Absent,
			Required:         d.Required,
			Attempts:         st.Attempts,
			Failures:         st.Failures,
			Results:          orEmpty(st.Results),
			Recreations:      orEmpty(st.Recreations),
			EndpointRestarts: st.EndpointRestarts,
			HeldByOther:      st.HeldByOther,
			LastError:        st.LastError,
			Since:            st.Since,
			NextAttempt:      st.NextAttempt,
		},
		Timeout:  h.Timeout,
		Failures: h.Failures,
		Sockets:  socketsWire(h.SentIn(1)),
	}
}

// altPathV1 is d's second registration path as v0.1.0 derives it: a driver whose endpoint
// is a pattern has one, no other. v0.1.0 compares every key of the spec with its own
// configuration's, so a second path it would not give the driver (a DRA driver's with a
// fixed endpoint, from v0.2.0) would make it register the driver anew.
func altPathV1(d config.Driver) string {
	if !d.RollsOver() {
		return ""
	}
	return d.AltSocketPath
}

// wireV2 is h in a batch of version 2.
func (h *Driver) wireV2() *wireDriverV2 {
	if h == nil {
		return nil
	}
	return &wireDriverV2{
		Spec:          specWire(h.Spec),
		Endpoint:      h.Endpoint,
		LocalEndpoint: h.LocalEndpoint,
		EndpointID:    idWire(h.EndpointID),
		NodeInfo:      h.NodeInfo,
		Status:        wireStatusV2(statusWire(h.Status)),
		Timeout:       h.Timeout,
		Failures:      h.Failures,
		Sockets:       socketsWire(h.SentIn(2)),
	}
}

// socketsWire is sockets on the wire, in either version.
func socketsWire(sockets []*Socket) []*wireSocket {
	var out []*wireSocket
	for _, hs := range sockets {
		out = append(out, &wireSocket{
			Prev:          hs.Prev,
			Path:          hs.Path,
			ID:            idWire(hs.ID),
			Generation:    hs.Generation,
			Registered:    hs.Registered,
			AwaitsVerdict: hs.AwaitsVerdict,
			Endpoint:      hs.Endpoint,
			LocalEndpoint: hs.LocalEndpoint,
			Versions:      hs.Versions,
		})
	}
	return out
}

// orEmpty is m, or an empty map for nil.
func orEmpty(m map[string]int) map[string]int {
	if m == nil {
		return map[string]int{}
	}
	return m
}

// driver is w, a driver of any version, as this process holds it.
func (w *wireDriverV2) driver() Driver {
	h := Driver{
		Endpoint:      w.Endpoint,
		LocalEndpoint: w.LocalEndpoint,
		EndpointID:    w.EndpointID.id(),
		NodeInfo:      w.NodeInfo,
		Status:        Status(w.Status),
		Timeout:       w.Timeout,
		Failures:      w.Failures,
	}
	h.Spec = w.Spec.driver()
	for _, ws := range w.Sockets {
		if ws == nil { // fill refuses the batch
			h.Sockets = append(h.Sockets, nil)
			continue
		}
		h.Sockets = append(h.Sockets, &Socket{
			Prev:          ws.Prev,
			Path:          ws.Path,
			ID:            ws.ID.id(),
			Generation:    ws.Generation,
			Registered:    ws.Registered,
			AwaitsVerdict: ws.AwaitsVerdict,
			Endpoint:      ws.Endpoint,
			LocalEndpoint: ws.LocalEndpoint,
			Versions:      ws.Versions,
		})
	}
	return h
}

// specWire is d in version 2: every field, sent (SupportedVersions when there are some).
func specWire(d config.Driver) wireSpecV2 {
	b := backoffWire(d.Backoff)
	return wireSpecV2{
		Name:                d.Name,
		Type:                &d.Type,
		Endpoint:            &d.Endpoint,
		LocalEndpoint:       &d.LocalEndpoint,
		SupportedVersions:   d.SupportedVersions,
		SocketName:          &d.SocketName,
		SocketPath:          &d.SocketPath,
		AltSocketPath:       &d.AltSocketPath,
		Backoff:             &b,
		RegistrationTimeout: &d.RegistrationTimeout,
		WaitForEndpoint:     &d.WaitForEndpoint,
		Required:            &d.Required,
	}
}

// backoffWire is b on the wire, in either version.
func backoffWire(b config.Backoff) wireBackoff {
	return wireBackoff{
		InitialInterval:     b.InitialInterval,
		MaxInterval:         b.MaxInterval,
		Multiplier:          b.Multiplier,
		RandomizationFactor: b.RandomizationFactor,
	}
}

// driver is the configuration w says. The fields it did not say are zero: the receiver runs
// its own configuration's (and RegistersAs counts its own for the registration's).
func (w *wireSpecV2) driver() config.Driver {
	var d config.Driver
	d.Name = w.Name
	str := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	d.Type = str(w.Type)
	d.Endpoint = str(w.Endpoint)
	d.LocalEndpoint = str(w.LocalEndpoint)
	d.SocketName = str(w.SocketName)
	d.SocketPath = str(w.SocketPath)
	d.AltSocketPath = str(w.AltSocketPath)
	d.SupportedVersions = w.SupportedVersions
	if b := w.Backoff; b != nil {
		d.Backoff = config.Backoff{InitialInterval: b.InitialInterval, MaxInterval: b.MaxInterval,
			Multiplier: b.Multiplier, RandomizationFactor: b.RandomizationFactor}
	}
	if w.RegistrationTimeout != nil {
		d.RegistrationTimeout = *w.RegistrationTimeout
	}
	if w.WaitForEndpoint != nil {
		d.WaitForEndpoint = *w.WaitForEndpoint
	}
	if w.Required != nil {
		d.Required = *w.Required
	}
	return d
}

// statusWire is st as either version writes it: its last error cut to maxLastError bytes of
// valid UTF-8.
func statusWire(st Status) Status {
	if len(st.LastError) > maxLastError {
		st.LastError = strings.ToValidUTF8(st.LastError[:maxLastError], "") + "…"
	}
	return st
}

func idWire(id fsid.ID) wireID {
	sec, nsec := id.Ctime.Unix()
	return wireID{Dev: id.Dev, Ino: id.Ino, CSec: sec, CNsec: nsec}
}

func (w wireID) id() fsid.ID {
	return fsid.ID{Dev: w.Dev, Ino: w.Ino, Ctime: syscall.NsecToTimespec(w.CSec*1e9 + w.CNsec)}
}

// unsent lists the fields of config.Registration that a predecessor did not send, by name
// (the spec's keys are the fields' names): the receiver's own count for them.
type unsent []string

// unsentOf lists the fields of config.Registration whose key is not in spec, a driver's spec
// as sent: a field a predecessor's version does not carry (SparePath: the receiver derives it
// from the rest), or that it left out.
func unsentOf(spec map[string]json.RawMessage) unsent {
	var u unsent
	typ := reflect.TypeFor[config.Registration]()
	for i := range typ.NumField() {
		name := typ.Field(i).Name
		if v, ok := spec[name]; !ok || string(v) == "null" {
			u = append(u, name)
		}
	}
	return u
}

// derived are the fields of config.Registration that follow from the others
// (config.Driver.SetSocketPaths: a driver's second and third registration paths): the
// receiver's own count for them, whatever the predecessor sent, so that a release that gives
// a driver another path (every DRA driver a second one) takes over its sockets all the same. A
// socket handed over in a path the receiver's configuration does not have is not served.
var derived = []string{"AltSocketPath", "SparePath"}

// RegistersAs reports whether own, this instance's configuration of the handed driver,
// registers it with kubelet as the instance that handed it over did: the same
// config.Registration, all that kubelet sees of a registration. The rest of the driver (where
// this process reaches the endpoint, the loop's policy, what status shows) does not count:
// own's applies to the loop that goes on. A field of the registration the predecessor did not
// send, or that follows from the others (derived), counts as own's.
func (h *Driver) RegistersAs(own config.Driver) bool {
	theirs := h.Spec.Registration
	tv, ov := reflect.ValueOf(&theirs).Elem(), reflect.ValueOf(own.Registration)
	for _, name := range slices.Concat(h.unsent, derived) {
		tv.FieldByName(name).Set(ov.FieldByName(name))
	}
	return theirs.Equal(own.Registration)
}
