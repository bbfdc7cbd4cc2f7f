package handover

import (
	"encoding/json"
	"reflect"
	"strings"
	"syscall"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
)

// The wire format of a batch's drivers, and the one place where the in-memory types (Driver,
// Socket, config.Driver, fsid.ID) become it and come back from it.
//
// Every type a message holds is one of this file's, each field with its key: no type of
// another package is encoded, so that a change elsewhere never changes what a peer reads.
// Versions 1 and 2 have the same batch; the keys of the spec and the status are the Go field
// names that v0.1.0 encoded (it sent config.Driver and its loop's status as they were), kept so
// that a peer of either version reads them. A field a peer does not send takes the
// receiver's own value (its configuration of the driver), never a zero that would make the
// loop behave otherwise: the spec's fields are pointers, nil when not sent.
//
// Changing any of it changes what an older peer reads: it needs a new protocol version
// (maxVersion), and a golden file of it (testdata/protocol-v<N>.json, wire_test.go).

// wireDriver is a driver in a batch.
type wireDriver struct {
	Spec          wireSpec   `json:"spec"`
	Endpoint      string     `json:"endpoint"`
	LocalEndpoint string     `json:"localEndpoint"`
	EndpointID    wireID     `json:"endpointID"`
	NodeInfo      []byte     `json:"nodeInfo,omitempty"`
	Status        wireStatus `json:"status"`
	// Timeout is the registration timeout in force (nanoseconds); 0 or absent: the
	// receiver's own.
	Timeout  time.Duration `json:"timeout"`
	Failures int           `json:"failures"`
	Sockets  []*wireSocket `json:"sockets,omitempty"`
}

// wireSpec is the driver's configuration as the sender ran it.
type wireSpec struct {
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

// wireBackoff is the driver's backoff policy (durations in nanoseconds).
type wireBackoff struct {
	InitialInterval     time.Duration `json:"InitialInterval"`
	MaxInterval         time.Duration `json:"MaxInterval"`
	Multiplier          float64       `json:"Multiplier"`
	RandomizationFactor float64       `json:"RandomizationFactor"`
}

// wireStatus is where the driver's loop stood.
type wireStatus struct {
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

// wireSocket is one listening registration socket; its descriptor travels beside the message.
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

// wireID is a file's identity: device, inode and change time, the change time in int64
// seconds and nanoseconds (a Timespec's fields are 32-bit on linux/arm).
type wireID struct {
	Dev   uint64 `json:"dev"`
	Ino   uint64 `json:"ino"`
	CSec  int64  `json:"ctimeSec"`
	CNsec int64  `json:"ctimeNsec"`
}

// maxLastError bounds the last error a driver's status carries: a batch must fit one message.
const maxLastError = 4 << 10

// MarshalJSON encodes h as a batch carries it.
func (h *Driver) MarshalJSON() ([]byte, error) { return json.Marshal(h.wire()) }

// UnmarshalJSON decodes a batch's driver. Its descriptors are not there: fill gives them.
func (h *Driver) UnmarshalJSON(b []byte) error {
	var w wireDriver
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

// wire is h on the wire.
func (h *Driver) wire() *wireDriver {
	w := &wireDriver{
		Spec:          specWire(h.Spec),
		Endpoint:      h.Endpoint,
		LocalEndpoint: h.LocalEndpoint,
		EndpointID:    idWire(h.EndpointID),
		NodeInfo:      h.NodeInfo,
		Status:        statusWire(h.Status),
		Timeout:       h.Timeout,
		Failures:      h.Failures,
	}
	for _, hs := range h.Sockets {
		w.Sockets = append(w.Sockets, &wireSocket{
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
	return w
}

// driver is w as this process holds it.
func (w *wireDriver) driver() Driver {
	h := Driver{
		Endpoint:      w.Endpoint,
		LocalEndpoint: w.LocalEndpoint,
		EndpointID:    w.EndpointID.id(),
		NodeInfo:      w.NodeInfo,
		Status:        w.Status.status(),
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

// specWire is d on the wire: every field, sent.
func specWire(d config.Driver) wireSpec {
	return wireSpec{
		Name:              d.Name,
		Type:              &d.Type,
		Endpoint:          &d.Endpoint,
		LocalEndpoint:     &d.LocalEndpoint,
		SupportedVersions: d.SupportedVersions,
		SocketName:        &d.SocketName,
		SocketPath:        &d.SocketPath,
		AltSocketPath:     &d.AltSocketPath,
		Backoff: &wireBackoff{
			InitialInterval:     d.Backoff.InitialInterval,
			MaxInterval:         d.Backoff.MaxInterval,
			Multiplier:          d.Backoff.Multiplier,
			RandomizationFactor: d.Backoff.RandomizationFactor,
		},
		RegistrationTimeout: &d.RegistrationTimeout,
		WaitForEndpoint:     &d.WaitForEndpoint,
		Required:            &d.Required,
	}
}

// driver is the configuration w says. The fields it did not say are zero: the receiver runs
// its own configuration's (and RegistersAs counts its own for the registration's).
func (w *wireSpec) driver() config.Driver {
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

// statusWire is st on the wire, its last error cut to maxLastError bytes of valid UTF-8.
func statusWire(st Status) wireStatus {
	if len(st.LastError) > maxLastError {
		st.LastError = strings.ToValidUTF8(st.LastError[:maxLastError], "") + "…"
	}
	return wireStatus(st)
}

// status is w as this process holds it.
func (w wireStatus) status() Status { return Status(w) }

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

// RegistersAs reports whether own, this instance's configuration of the handed driver,
// registers it with kubelet as the instance that handed it over did: the same
// config.Registration, all that kubelet sees of a registration. The rest of the driver (where
// this process reaches the endpoint, the loop's policy, what status shows) does not count:
// own's applies to the loop that goes on. A field of the registration the predecessor did not
// send counts as own's.
func (h *Driver) RegistersAs(own config.Driver) bool {
	theirs := h.Spec.Registration
	tv, ov := reflect.ValueOf(&theirs).Elem(), reflect.ValueOf(own.Registration)
	for _, name := range h.unsent {
		tv.FieldByName(name).Set(ov.FieldByName(name))
	}
	return theirs.Equal(own.Registration)
}
