// Package health answers, for each driver of the drivers file, whether the driver itself is
// alive, asked at request time: what kubernetes-csi/livenessprobe answers for one CSI driver,
// for every driver of the node, on one port (GET /healthz/<driver>) and as the standard gRPC
// health service (service = the driver's name), so that a driver pod's livenessProbe can point
// at multireg and kubelet restarts a hung driver.
//
// A check never changes a registration, and never waits for the registration loops; a
// hung driver holds its own checks only, each bounded by the driver's healthTimeout. Checks
// of one driver that come while one is in flight share its answer: a probe storm opens one
// connection to a driver at a time. Nothing runs while nobody asks.
package health

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"

	"multireg.dev/multireg/internal/probe"
)

// Target is a driver as a check sees it.
type Target struct {
	Name, Type string
	// Path is the driver's socket as this process reaches it (its localEndpoint, or the
	// pattern's match the loop registers).
	Path string
	// Timeout bounds a check (the driver's healthTimeout).
	Timeout time.Duration
}

// Result is one check's answer.
type Result struct {
	At   time.Time
	Took time.Duration
	// Err is nil when the driver is alive; errors.Is(Err, probe.ErrNotReady) when it says it
	// is not.
	Err error
}

// Checker checks drivers. Close waits for the checks in flight.
type Checker struct {
	targets func(name string) (Target, bool)
	log     *slog.Logger
	ops     *prometheus.HistogramVec

	mu       sync.Mutex
	closed   bool
	inflight map[string]*call
	last     map[string]Result
	wg       sync.WaitGroup
}

// call is a check in flight; done closes when res is set.
type call struct {
	done chan struct{}
	res  Result
}

// New returns a checker of the drivers targets says (false: no such driver).
func New(targets func(name string) (Target, bool), log *slog.Logger) *Checker {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Checker{
		targets: targets, log: log,
		inflight: map[string]*call{}, last: map[string]Result{},
		// kubernetes-csi/livenessprobe's metric (csi-lib-utils' operations_seconds, with the
		// csi_sidecar namespace), so that its dashboards read multireg's.
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "csi_sidecar_operations_seconds",
			Help:    "Duration of the gRPC calls of the drivers' liveness checks (a CSI driver's Identity.Probe, a DRA driver's gRPC health Check, a device plugin's GetDevicePluginOptions), by driver, method and gRPC status code, as kubernetes-csi/livenessprobe reports its Probe calls.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600},
		}, []string{"driver_name", "method_name", "grpc_status_code"}),
	}
}

// ErrUnknown: no driver of that name in the drivers file.
var ErrUnknown = errors.New("no driver of that name in the drivers file")

// errClosed: the checker is closed (multireg stops).
var errClosed = errors.New("multireg is stopping")

// Check asks the named driver whether it is alive, and returns the answer, or ErrUnknown. A
// check of the driver in flight is shared; the caller waits for it until ctx ends (its own
// timeout), the check until the driver's.
func (c *Checker) Check(ctx context.Context, name string) (Result, error) {
	t, ok := c.targets(name)
	if !ok {
		return Result{}, ErrUnknown
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return Result{}, errClosed
	}
	cl := c.inflight[name]
	if cl == nil {
		cl = &call{done: make(chan struct{})}
		c.inflight[name] = cl
		c.wg.Add(1)
		go c.run(t, cl) // owned by c: Close waits for it
	}
	c.mu.Unlock()
	select {
	case <-cl.done:
		return cl.res, nil
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

// run makes one check of t, bounded by its timeout, and hands its answer to those waiting.
func (c *Checker) run(t Target, cl *call) {
	defer c.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), t.Timeout)
	start := time.Now()
	err := probe.Live(ctx, t.Type, t.Path)
	cancel()
	res := Result{At: start, Took: time.Since(start), Err: err}
	code := status.Code(err)
	if errors.Is(err, probe.ErrNotReady) {
		code = 0 // the call succeeded: the driver said it is not ready (OK, as livenessprobe counts it)
	}
	c.ops.WithLabelValues(t.Name, probe.LiveMethod(t.Type), code.String()).Observe(res.Took.Seconds())
	c.mu.Lock()
	delete(c.inflight, t.Name)
	c.last[t.Name] = res
	c.mu.Unlock()
	cl.res = res
	close(cl.done)
	if err != nil {
		c.log.Debug("liveness check failed", "driver", t.Name, "err", err, "took", res.Took.Round(time.Millisecond))
	}
}

// Last returns the last answer of the named driver, if it was ever checked.
func (c *Checker) Last(name string) (Result, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.last[name]
	return r, ok
}

// Forget drops what is known of drivers no longer in the file (keep reports which stay).
func (c *Checker) Forget(keep func(name string) bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for name := range c.last {
		if !keep(name) {
			delete(c.last, name)
			c.ops.DeletePartialMatch(prometheus.Labels{"driver_name": name})
		}
	}
}

// Collector is the checks' metric.
func (c *Checker) Collector() prometheus.Collector { return c.ops }

// Close refuses new checks and waits for those in flight (each bounded by its timeout).
func (c *Checker) Close() {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.wg.Wait()
}
