// Package podres reads kubelet's own view of the node's device-plugin resources: the
// devices kubelet's device manager holds and counts allocatable, per resource name, from
// kubelet's node-local pod-resources API (k8s.io/kubelet/pkg/apis/podresources/v1,
// GetAllocatableResources, GA since Kubernetes 1.28; unix socket
// <kubelet root>/pod-resources/kubelet.sock, root only).
//
// It is evidence, not inference: what a registration did to a device plugin's resource is
// read from kubelet rather than guessed from what kubelet probably is. One View serves a
// whole process: it reads once a reconcile pass (Period), and every QuickPeriod while a loop
// watches a registration's outcome (Quick).
package podres

import (
	"context"
	"log/slog"
	"maps"
	"net"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/sockfile"
)

const (
	// Period is how often the view reads kubelet when no loop asks for more: kubelet's
	// reconcile period, the pace at which registrations change.
	Period = time.Second
	// QuickPeriod is how often it reads while a loop watches a registration's outcome. kubelet
	// rate-limits the API (100 calls a second by default): 20 a second leaves room for others.
	QuickPeriod = 50 * time.Millisecond
	// callTimeout bounds one read.
	callTimeout = time.Second
	// transientReads is how many reads in a row may fail, the socket still the file it was,
	// before the view takes kubelet's API for down: kubelet limits the API's rate for every
	// client of the node together (ResourceExhausted), and a busy kubelet may miss a read.
	transientReads = 3
)

// SocketPath is the pod-resources socket of the kubelet whose plugins-registry directory is
// registrationDir (<root>/plugins_registry → <root>/pod-resources/kubelet.sock).
func SocketPath(registrationDir string) string {
	return filepath.Join(filepath.Dir(filepath.Clean(registrationDir)), "pod-resources", "kubelet.sock")
}

// Reading is one answer of kubelet: the allocatable devices of each device-plugin resource.
type Reading struct {
	// At is when kubelet answered; zero before any answer.
	At time.Time
	// Devices counts the allocatable devices of each resource kubelet's device manager
	// holds. A resource it does not list has none.
	Devices map[string]int
	// since is when each resource's count became what it is, as far as this view has seen:
	// at the first reading for a resource never seen with devices.
	since map[string]time.Time
	// had is the last reading at which each resource had devices.
	had   map[string]time.Time
	first time.Time
}

// HadAt is the last reading at which resource had devices; zero if none did.
func (r Reading) HadAt(resource string) time.Time {
	return r.had[resource]
}

// Count is what the reading says of resource: its allocatable devices, and since when kubelet
// has held that many (as far as the view has read; the first reading's time for a resource
// absent since). ok is false before any reading.
func (r Reading) Count(resource string) (n int, since time.Time, ok bool) {
	if r.At.IsZero() {
		return 0, time.Time{}, false
	}
	since, seen := r.since[resource]
	if !seen {
		since = r.first
	}
	return r.Devices[resource], since, true
}

// View is a process's reading of kubelet's pod-resources API, kept fresh by Run. A nil View
// reads nothing: Available is false and Last is empty.
type View struct {
	path string
	log  *slog.Logger

	// guards: last, up, down, failed, sock, runs, changed, quickUntil. (wake is a channel,
	// set by New.)
	mu   sync.Mutex
	last Reading
	// up: kubelet's API answers (its last read did, or the reads since failed only for a
	// moment: failed, fewer than transientReads, the socket the same file). down: it was
	// taken for down and logged, and has not answered since.
	up, down bool
	failed   int
	// sock is the socket file kubelet's API last answered on: kubelet creates it anew when it
	// starts. runs counts the sockets it answered on: each is another run of kubelet, maybe
	// another kubelet. A read that fails, and answers again on the same socket, is the same
	// run.
	sock fsid.ID
	runs int
	// changed is closed, and replaced, when a read finds another count or availability.
	changed chan struct{}
	// quickUntil: read every QuickPeriod until then.
	quickUntil time.Time
	// wake: cap 1; a loop asked for quick reads.
	wake chan struct{}
}

// New returns the View of the pod-resources socket at path (the path this process sees).
func New(path string, log *slog.Logger) *View {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &View{path: path, log: log, changed: make(chan struct{}), wake: make(chan struct{}, 1)}
}

// Path is the socket the view reads; "" for a nil View.
func (v *View) Path() string {
	if v == nil {
		return ""
	}
	return v.path
}

// Run reads kubelet until ctx ends, once a Period, or once a QuickPeriod while a loop asked
// (Quick). It returns when ctx ends; the caller owns it and waits for it.
func (v *View) Run(ctx context.Context) {
	// gRPC reconnects with a backoff of up to 2 minutes by default: a kubelet back from a
	// restart is read again within a second.
	conn, err := grpc.NewClient("passthrough:///localhost",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return sockfile.Dial(ctx, v.path) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: Period},
			MinConnectTimeout: callTimeout,
		}))
	if err != nil { // only a malformed target fails here
		v.log.Error("kubelet's pod-resources API", "socket", v.path, "err", err)
		return
	}
	defer conn.Close()
	client := podresourcesv1.NewPodResourcesListerClient(conn)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-v.wake:
			t.Stop()
		}
		v.read(ctx, client)
		t.Reset(v.next())
	}
}

// next is the wait before the next read.
func (v *View) next() time.Duration {
	v.mu.Lock()
	defer v.mu.Unlock()
	if time.Now().Before(v.quickUntil) {
		return QuickPeriod
	}
	return Period
}

// read asks kubelet once and records the answer, or that there was none.
func (v *View) read(ctx context.Context, client podresourcesv1.PodResourcesListerClient) {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	resp, err := client.GetAllocatableResources(cctx, &podresourcesv1.AllocatableResourcesRequest{})
	cancel()
	if ctx.Err() != nil {
		return
	}
	now := time.Now()
	sock, _, statErr := fsid.Stat(v.path)
	v.mu.Lock()
	defer v.mu.Unlock()
	if err != nil {
		v.failed++
		if v.up && statErr == nil && sock == v.sock && v.failed < transientReads {
			v.log.Debug("kubelet's pod-resources API did not answer a read; the socket is the same: reading on", "socket", v.path, "err", err)
			return
		}
		if v.up || !v.down {
			v.log.Warn("kubelet's pod-resources API does not answer: kubelet's view of device plugins is not shown, "+
				"and a device plugin's move to a new endpoint cannot be verified",
				"socket", v.path, "err", err)
			v.down = true
		}
		if v.up {
			v.up = false
			v.notify()
		}
		return
	}
	v.failed = 0
	if statErr == nil && sock != v.sock {
		v.sock = sock
		v.runs++ // kubelet made its socket anew: another run
		if v.up {
			v.log.Info("kubelet's pod-resources API answers on a new socket: kubelet restarted", "socket", v.path)
			v.notify()
		}
	}
	if !v.up {
		v.log.Info("kubelet's pod-resources API answers: device plugins' resources are read from kubelet", "socket", v.path)
		v.up, v.down = true, false
		v.notify()
	}
	devices := map[string]int{}
	for _, cd := range resp.GetDevices() {
		devices[cd.GetResourceName()] += len(cd.GetDeviceIds())
	}
	r := Reading{At: now, Devices: devices, since: maps.Clone(v.last.since), had: maps.Clone(v.last.had), first: v.last.first}
	if r.since == nil {
		r.since, r.had, r.first = map[string]time.Time{}, map[string]time.Time{}, now
	}
	for name, n := range devices {
		if n > 0 {
			r.had[name] = now
		}
	}
	changed := false
	for name, n := range devices {
		if _, seen := r.since[name]; !seen || v.last.Devices[name] != n {
			r.since[name], changed = now, true
		}
	}
	for name := range r.since {
		if _, listed := devices[name]; !listed && v.last.Devices[name] != 0 {
			r.since[name], changed = now, true
		}
	}
	v.last = r
	if changed {
		v.notify()
	}
}

// notify wakes whoever waits on Changed. Its caller holds mu.
func (v *View) notify() {
	close(v.changed)
	v.changed = make(chan struct{})
}

// Last returns the last reading, and whether kubelet answered the last read.
func (v *View) Last() (Reading, bool) {
	r, up, _ := v.State()
	return r, up
}

// State returns the last reading, whether kubelet's API answers, and how many sockets it has
// answered on: a count that moves when kubelet restarted, and only then.
func (v *View) State() (Reading, bool, int) {
	if v == nil {
		return Reading{}, false, 0
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.last, v.up, v.runs
}

// Available reports whether kubelet answered the last read.
func (v *View) Available() bool {
	_, up := v.Last()
	return up
}

// Changed returns a channel closed at the next read that finds another count for some
// resource, or a change of availability. A nil View's never is.
func (v *View) Changed() <-chan struct{} {
	if v == nil {
		return nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.changed
}

// Quick asks for a read now and every QuickPeriod for d: a loop watches what a registration
// did. It never blocks.
func (v *View) Quick(d time.Duration) {
	if v == nil {
		return
	}
	v.mu.Lock()
	if until := time.Now().Add(d); until.After(v.quickUntil) {
		v.quickUntil = until
	}
	v.mu.Unlock()
	select {
	case v.wake <- struct{}{}:
	default:
	}
}
