package registrar

import (
	"log/slog"
	"os"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/sockfile"
)

// Snapshot is what one instance hands the next (handover.go): for each driver, its
// configuration, its listening registration sockets and where its loop stands. A Supervisor
// given one (Inherit) serves those sockets for every driver whose configuration is unchanged,
// so that kubelet sees nothing. Whoever holds a Snapshot owns its descriptors until Close.
type Snapshot struct {
	drivers map[string]*handedDriver
}

// handedDriver is one driver's part of a hand-over: enough for its loop to go on exactly
// where the other instance's stood.
type handedDriver struct {
	// Spec is the driver as the handing instance ran it: the new instance serves the sockets
	// only when its own configuration registers the driver the same way.
	Spec config.Driver `json:"spec"`
	// Endpoint and LocalEndpoint: the target the loop registered (a pattern's match).
	Endpoint      string `json:"endpoint"`
	LocalEndpoint string `json:"localEndpoint"`
	// EndpointID is the endpoint's socket as last probed: another one means the driver
	// restarted meanwhile.
	EndpointID wireID `json:"endpointID"`
	// NodeInfo is a CSI driver's NodeGetInfo answer recorded at registration (protobuf).
	NodeInfo []byte `json:"nodeInfo,omitempty"`
	// Status is the loop's status: phase, counters, last error, next attempt.
	Status DriverStatus `json:"status"`
	// Timeout is the registration timeout in force; Failures how many failures the backoff
	// has counted since it was last reset.
	Timeout  time.Duration   `json:"timeout"`
	Failures int             `json:"failures"`
	Sockets  []*handedSocket `json:"sockets,omitempty"`
}

// handedSocket is one listening registration socket.
type handedSocket struct {
	// Prev: the previous generation of a DRA driver's endpoint hand-over (pattern.go), kept
	// until its successor is registered.
	Prev       bool   `json:"prev,omitempty"`
	Path       string `json:"path"`
	ID         wireID `json:"id"`
	Generation uint64 `json:"generation"`
	Registered bool   `json:"registered"`
	// AwaitsVerdict: kubelet asked GetInfo and its verdict has not come: it may reach the new
	// instance, on a connection of its own.
	AwaitsVerdict bool   `json:"awaitsVerdict,omitempty"`
	Endpoint      string `json:"endpoint"`
	LocalEndpoint string `json:"localEndpoint"`
	// Versions are the supportedVersions the socket's GetInfo answers (the driver's, and the
	// health services detected: health.go). An older instance does not send them: it
	// answered the configured ones.
	Versions []string `json:"versions,omitempty"`

	f *os.File // the listening socket; nil once taken
}

// Len is the number of drivers in s.
func (s *Snapshot) Len() int {
	if s == nil {
		return 0
	}
	return len(s.drivers)
}

// Sockets is the number of sockets s holds.
func (s *Snapshot) Sockets() int {
	return s.count(func(*handedSocket) bool { return true })
}

// Alive is the number of sockets of s that are still the files at their paths.
func (s *Snapshot) Alive() int {
	return s.count(func(hs *handedSocket) bool { return socketAt(hs.Path, hs.ID.id()) == nil })
}

// count is the number of sockets s holds for which ok holds.
func (s *Snapshot) count(ok func(*handedSocket) bool) int {
	if s == nil {
		return 0
	}
	n := 0
	for _, h := range s.drivers {
		for _, hs := range h.Sockets {
			if hs.f != nil && ok(hs) {
				n++
			}
		}
	}
	return n
}

// Close closes every descriptor s still holds. A nil Snapshot closes nothing.
func (s *Snapshot) Close() {
	if s == nil {
		return
	}
	for _, h := range s.drivers {
		h.close()
	}
	s.drivers = nil
}

// take removes the named driver from s and returns it, or nil.
func (s *Snapshot) take(name string) *handedDriver {
	if s == nil {
		return nil
	}
	h := s.drivers[name]
	delete(s.drivers, name)
	return h
}

func (h *handedDriver) close() {
	for _, hs := range h.Sockets {
		if hs.f != nil {
			hs.f.Close()
			hs.f = nil
		}
	}
}

// add puts h in s, replacing (and closing) an older part for the same driver.
func (s *Snapshot) add(h *handedDriver) {
	if s.drivers == nil {
		s.drivers = map[string]*handedDriver{}
	}
	if old := s.drivers[h.Spec.Name]; old != nil {
		old.close()
	}
	s.drivers[h.Spec.Name] = h
}

// merge moves every driver of o into s; o's parts win.
func (s *Snapshot) merge(o *Snapshot) {
	if o == nil {
		return
	}
	for _, h := range o.drivers {
		s.add(h)
	}
	o.drivers = nil
}

// retire removes the sockets of a handed driver that no loop takes over (removed from the
// configuration, or registering differently now), as a reload would remove them: each only if
// it is still the socket handed over.
func (h *handedDriver) retire(log *slog.Logger) {
	for _, hs := range h.Sockets {
		if hs.f == nil {
			continue
		}
		hs.f.Close()
		hs.f = nil
		if removed, err := sockfile.RemoveIfOurs(hs.Path, hs.ID.id()); err != nil {
			log.Warn("remove registration socket", "socket", hs.Path, "err", err)
		} else if removed {
			log.Info("registration socket removed; kubelet deregisters the plugin", "socket", hs.Path)
		}
	}
}

// nodeInfo decodes the recorded NodeGetInfo answer; nil when none.
func (h *handedDriver) nodeInfo() *csi.NodeGetInfoResponse {
	if len(h.NodeInfo) == 0 {
		return nil
	}
	var r csi.NodeGetInfoResponse
	if proto.Unmarshal(h.NodeInfo, &r) != nil {
		return nil
	}
	return &r
}
