//go:build linux

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"multireg.dev/multireg/health"
	"multireg.dev/multireg/nodecond"
	"multireg.dev/multireg/nodecond/relay"
	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

// Timeouts of the HTTP server: a slow or stuck client cannot hold the daemon's resources.
const (
	httpReadTimeout  = 10 * time.Second
	httpWriteTimeout = 10 * time.Second
	httpIdleTimeout  = time.Minute
	httpShutdown     = 2 * time.Second
)

// daemonState is what the HTTP handlers read.
type daemonState struct {
	drivers func() []registrar.DriverStatus
	config  func() reload.State
	// takenOver counts the sockets the previous instance handed over that the loops serve;
	// nil for none.
	takenOver func() int
	// descriptors: the registration sockets' descriptor budget; nil: not known.
	descriptors func() registrar.Descriptors
	// podResources: kubelet's pod-resources API as the instance reads it; nil: not known.
	podResources func() (registrar.PodResources, bool)
	// nodeCondition: the node condition as the instance's agent keeps it, and the agent; nil:
	// it keeps none.
	nodeCondition func() (nodecond.Status, relay.Agent)
	// liveness: a driver's last liveness check; nil: not known.
	liveness func(name string) (health.Result, bool)
	// loops counts the daemon loops that run (the reloader and the supervisor); healthy
	// means both.
	loops atomic.Int32
}

// newRegistry returns the metrics registry of the daemon: multireg's metrics, build info, Go
// runtime and process metrics. Without a supervisor and a reloader (a process that does not
// serve the directory), only the last three.
func newRegistry(sup *registrar.Supervisor, rl *reload.Reloader, cond *relay.Relay) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "multireg_build_info",
		Help: "Always 1; the labels say which multireg runs.",
	}, []string{"version", "commit", "goversion"})
	build.WithLabelValues(version, commit, runtime.Version()).Set(1)
	reg.MustRegister(
		build,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	if sup != nil {
		reg.MustRegister(registrar.NewCollector(sup), reload.NewCollector(rl))
	}
	if cond != nil {
		reg.MustRegister(relay.NewCollector(cond))
	}
	return reg
}

// newStatusDoc renders the process's state; times are RFC 3339 (UTC), absent ones null. A
// process that does not serve the directory has no configuration applied and no drivers.
func newStatusDoc(v instanceView) statusDoc {
	var cfg reload.State
	var drivers []registrar.DriverStatus
	if v.State != nil {
		cfg, drivers = v.State.config(), v.State.drivers()
	}
	doc := statusDoc{
		Instance: instanceStatus{Role: v.Role, Since: timePtr(v.Since), Detail: v.Detail, TakenOver: v.TakenOver},
		Config: configStatus{
			Path:                 cfg.Path,
			Generation:           cfg.Generation,
			LastReloadSuccessful: cfg.LastReloadSuccessful,
			LastReloadError:      cfg.LastReloadError,
			LastReloadTime:       timePtr(cfg.LastReloadTime),
		},
		Drivers: make([]driverStatus, 0, len(drivers)),
	}
	if v.State != nil && v.State.descriptors != nil {
		d := v.State.descriptors()
		doc.Descriptors = &descriptorsStatus{
			Limit: d.Limit, Reserved: d.Reserved, MaxSockets: d.MaxSockets, Needed: d.Needed,
			Sockets: d.Sockets, Connections: d.Conns, Fits: d.Fits(), Problem: d.Problem(),
		}
	}
	if v.State != nil && v.State.podResources != nil {
		if p, ok := v.State.podResources(); ok {
			doc.PodResources = &podResourcesStatus{Socket: p.Socket, Answers: p.Answers, DevicePluginMoves: p.DevicePluginMoves}
		}
	}
	var cond *nodecond.Status
	var evidence map[string]nodecond.Evidence
	if v.State != nil && v.State.nodeCondition != nil {
		st, agent := v.State.nodeCondition()
		cond = &st
		doc.NodeCondition = nodeConditionDoc(st, agent)
		evidence = make(map[string]nodecond.Evidence, len(st.Verdict.Evidence))
		for _, e := range st.Verdict.Evidence {
			evidence[e.Driver] = e
		}
	}
	for _, d := range drivers { // sorted by name
		var kubelet *kubeletStatus
		if k := d.Kubelet; k != nil {
			kubelet = &kubeletStatus{Devices: k.Devices, ReadAt: timePtr(k.ReadAt), Since: timePtr(k.Since), Missing: k.Missing}
		}
		doc.Drivers = append(doc.Drivers, driverStatus{
			Name:        d.Name,
			Type:        d.Type,
			Display:     d.Display,
			Phase:       string(d.Phase),
			Socket:      d.Socket,
			Endpoint:    d.Endpoint,
			EndpointUp:  d.EndpointUp,
			Absent:      d.Absent,
			Required:    d.Required,
			HeldByOther: d.HeldByOther,
			InTheWay:    d.InTheWay,
			Attempts:    d.Attempts,
			Failures:    d.Failures,
			LastError:   d.LastError,
			Since:       timePtr(d.Since),
			NextAttempt: timePtr(d.NextAttempt),
			Kubelet:     kubelet,
		})
		if v.State != nil && v.State.liveness != nil {
			if res, ok := v.State.liveness(d.Name); ok {
				ls := &livenessStatus{At: timePtr(res.At), TookMs: float64(res.Took.Microseconds()) / 1000, Alive: res.Err == nil}
				if res.Err != nil {
					ls.Error = res.Err.Error()
				}
				doc.Drivers[len(doc.Drivers)-1].Liveness = ls
			}
		}
		if e, ok := evidence[d.Name]; ok {
			ds := &doc.Drivers[len(doc.Drivers)-1]
			ds.Held = &heldStatus{Held: e.Held, Why: e.Why}
			if d.Type == "CSIPlugin" && cond.CSINode.Known {
				since, listed := cond.CSINode.Drivers[d.Name]
				ds.CSINode = &csiNodeStatus{Listed: listed, Since: timePtr(since), Missing: e.NotListed}
			}
		}
	}
	return doc
}

// nodeConditionDoc is what /status says of the node condition.
func nodeConditionDoc(st nodecond.Status, agent relay.Agent) *nodeConditionStatus {
	v := st.Verdict
	doc := &nodeConditionStatus{
		Agent: agentStatus{Running: agent.Running, Starts: agent.Starts, LastExit: agent.LastExit},
		Type:  st.Type, Node: st.Node, Status: "False", Reason: v.Reason, Message: v.Message,
		Synced: st.Synced(), NodeRead: st.NodeRead, NodeExists: st.NodeExists, CSINodeRead: st.CSINode.Known,
		Writes: st.Writes, WriteErrors: st.WriteErrors, LastWrite: timePtr(st.LastWrite), LastError: st.LastError,
	}
	if v.True {
		doc.Status = "True"
	}
	if c := st.OnNode; c != nil {
		doc.OnNode = &onNodeStatus{Status: c.Status, Reason: c.Reason, Message: c.Message, LastTransitionTime: timePtr(c.LastTransitionTime)}
	}
	if t := st.Taint; t != nil {
		doc.StartupTaint = &startupTaintStatus{Taint: t.String(), Removed: timePtr(st.TaintRemoved), Done: st.TaintDone}
	}
	return doc
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC().Truncate(time.Millisecond)
	return &t
}

// newHandler serves /healthz, /readyz, /readyz/<driver>, /status and /metrics for whatever
// role the process has (instance.go). A process that does not serve the directory is healthy
// and ready: it waits for the directory, or has handed it over.
func newHandler(in *instance, checks http.Handler) http.Handler {
	mux := http.NewServeMux()
	if checks != nil {
		mux.Handle("GET "+health.Prefix+"{driver...}", checks)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		if st := in.view().State; st != nil {
			if n := st.loops.Load(); n < 2 {
				http.Error(w, fmt.Sprintf("not healthy: %d of 2 loops (reloader, supervisor) running", n), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	readyz := func(w http.ResponseWriter, r *http.Request) {
		v := in.view()
		switch {
		case v.Handing:
			http.Error(w, "not ready: handing the registration directory over to a new instance", http.StatusServiceUnavailable)
		case v.State != nil:
			var problem string
			if v.State.descriptors != nil && r.PathValue("driver") == "" {
				problem = v.State.descriptors().Problem()
			}
			ready(w, v.State.drivers(), r.PathValue("driver"), problem)
		case v.Role == roleStarting:
			http.Error(w, "not ready: starting: "+v.Detail, http.StatusServiceUnavailable)
		default:
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			fmt.Fprintf(w, "ok: %s: %s\n", v.Role, v.Detail)
		}
	}
	mux.HandleFunc("GET /readyz", readyz)
	mux.HandleFunc("GET /readyz/{driver...}", readyz)
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(newStatusDoc(in.view()))
	})
	mux.Handle("GET /metrics", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		promhttp.HandlerFor(in.view().gatherer(in), promhttp.HandlerOpts{}).ServeHTTP(w, r)
	}))
	return mux
}

// ready answers 200 when every driver (or the one named) is ready — Registered, or absent
// from this node without being required — else 503 with a line for each driver that is not:
// its phase and last error. Absent drivers are named on a line of their own, and problem
// (the drivers' sockets that do not fit in the process's descriptors), if any, on the last.
func ready(w http.ResponseWriter, drivers []registrar.DriverStatus, only, problem string) {
	var notReady, absent []string
	found := only == ""
	registered := 0
	for _, d := range drivers {
		if only != "" && d.Name != only {
			continue
		}
		found = true
		switch {
		case d.Phase == registrar.Registered:
			registered++
		case d.Ready():
			absent = append(absent, d.Name)
		default:
			line := fmt.Sprintf("%s: %s", d.Name, d.Phase)
			if d.Absent {
				line += ": required, and absent from this node"
			}
			if d.LastError != "" {
				line += ": " + d.LastError
			}
			notReady = append(notReady, line)
		}
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !found {
		http.Error(w, fmt.Sprintf("no driver %q in the configuration", only), http.StatusNotFound)
		return
	}
	n := count(drivers, only)
	if len(notReady) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "not ready: %d of %d drivers not registered\n%s\n", len(notReady), n, strings.Join(notReady, "\n"))
	} else {
		fmt.Fprintf(w, "ok: %d of %d drivers registered", registered, n)
		if len(absent) > 0 {
			fmt.Fprintf(w, ", %d absent from this node", len(absent))
		}
		fmt.Fprintln(w)
	}
	if len(absent) > 0 {
		fmt.Fprintf(w, "absent (not required): %s\n", strings.Join(absent, ", "))
	}
	if problem != "" {
		fmt.Fprintln(w, problem)
	}
}

func count(drivers []registrar.DriverStatus, only string) int {
	if only != "" {
		return 1
	}
	return len(drivers)
}

// newHTTPServer is an HTTP server of h, its connections kept within cc, its writes bounded by
// write.
func newHTTPServer(h http.Handler, cc *connCap, write time.Duration, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: httpReadTimeout,
		ReadTimeout:       httpReadTimeout,
		WriteTimeout:      write,
		IdleTimeout:       httpIdleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		ConnState:         cc.track,
	}
}

// shutdownHTTP stops srv, giving requests in flight a moment to finish.
func shutdownHTTP(srv *http.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), httpShutdown)
	defer cancel()
	if srv.Shutdown(ctx) != nil {
		srv.Close()
	}
}
