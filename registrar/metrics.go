package registrar

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exposes every driver's state as Prometheus metrics, read from the supervisor at
// scrape time: a driver that is removed loses its series at once, and no loop ever waits on
// metrics. Labels are bounded: driver names and types from the config, phases, results and
// reasons from fixed lists; never paths.
type Collector struct {
	s *Supervisor

	registered, phase, endpointUp, absent, required, heldByOther, attempts, recreations, restarts *prometheus.Desc
	kubeletDevices, kubeletMissing, podResourcesUp                                                *prometheus.Desc
}

// NewCollector returns the collector of s's drivers; register it on a registry.
func NewCollector(s *Supervisor) *Collector {
	return &Collector{
		s: s,
		registered: prometheus.NewDesc("multireg_driver_registered",
			"1 when kubelet reported the driver's current socket registered, else 0.",
			[]string{"driver", "type"}, nil),
		phase: prometheus.NewDesc("multireg_driver_phase",
			"1 for the phase the driver's loop is in (WaitingForEndpoint, Serving, Registered, BackingOff), 0 for the others.",
			[]string{"driver", "phase"}, nil),
		endpointUp: prometheus.NewDesc("multireg_endpoint_up",
			"1 when the driver's endpoint accepted a connection at the last look, else 0.",
			[]string{"driver"}, nil),
		absent: prometheus.NewDesc("multireg_driver_absent",
			"1 when no file was at the driver's endpoint at the last look: it does not run on this node, or its driver is down. An absent driver that is not required and not registered does not fail readiness.",
			[]string{"driver"}, nil),
		required: prometheus.NewDesc("multireg_driver_required",
			"1 when the driver is required on every node: its absence fails readiness.",
			[]string{"driver"}, nil),
		heldByOther: prometheus.NewDesc("multireg_driver_held_by_other",
			"1 while another process serves the driver's registration socket path (another registrar, such as a node-driver-registrar sidecar being migrated from): kubelet holds that registrar's registration, and multireg waits for it to go.",
			[]string{"driver"}, nil),
		attempts: prometheus.NewDesc("multireg_registration_attempts_total",
			"Registration attempts that ended, by result: registered, rejected (by kubelet), timeout (no verdict), publish_failed (socket not created).",
			[]string{"driver", "result"}, nil),
		recreations: prometheus.NewDesc("multireg_socket_recreations_total",
			"Registration sockets recreated, by reason: rejected, timeout, socket_removed, endpoint_restarted, devices_dropped (kubelet dropped a moved device plugin's devices: registered again).",
			[]string{"driver", "reason"}, nil),
		restarts: prometheus.NewDesc("multireg_endpoint_restarts_total",
			"Times the driver's endpoint socket was created anew while its registration socket was served (the driver restarted), whether its registration was kept or made again.",
			[]string{"driver"}, nil),
		kubeletDevices: prometheus.NewDesc("multireg_kubelet_devices",
			"The allocatable devices kubelet's device manager holds for a device plugin's resource, read from kubelet's pod-resources API (only while it answers).",
			[]string{"driver"}, nil),
		kubeletMissing: prometheus.NewDesc("multireg_kubelet_devices_missing",
			"1 when the device plugin is registered and kubelet has held none of its resource's devices for longer than a reconcile pass, else 0 (only while kubelet's pod-resources API answers).",
			[]string{"driver"}, nil),
		podResourcesUp: prometheus.NewDesc("multireg_kubelet_pod_resources_up",
			"1 when kubelet's pod-resources API answered the last read, else 0; absent when multireg reads none (--pod-resources-socket empty).",
			nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.registered, c.phase, c.endpointUp, c.absent, c.required, c.heldByOther, c.attempts, c.recreations, c.restarts,
		c.kubeletDevices, c.kubeletMissing, c.podResourcesUp} {
		ch <- d
	}
}

var (
	results = []string{ResultRegistered, ResultRejected, ResultTimeout, ResultPublishFailed}
	reasons = []string{ReasonRejected, ReasonTimeout, ReasonSocketRemoved, ReasonEndpointRestarted, ReasonDevicesDropped}
)

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, d := range c.s.Status() {
		ch <- prometheus.MustNewConstMetric(c.registered, prometheus.GaugeValue, boolValue(d.Phase == Registered), d.Name, d.Type)
		for _, p := range Phases {
			ch <- prometheus.MustNewConstMetric(c.phase, prometheus.GaugeValue, boolValue(d.Phase == p), d.Name, string(p))
		}
		ch <- prometheus.MustNewConstMetric(c.endpointUp, prometheus.GaugeValue, boolValue(d.EndpointUp), d.Name)
		ch <- prometheus.MustNewConstMetric(c.absent, prometheus.GaugeValue, boolValue(d.Absent), d.Name)
		ch <- prometheus.MustNewConstMetric(c.required, prometheus.GaugeValue, boolValue(d.Required), d.Name)
		ch <- prometheus.MustNewConstMetric(c.heldByOther, prometheus.GaugeValue, boolValue(d.HeldByOther), d.Name)
		for _, r := range results {
			ch <- prometheus.MustNewConstMetric(c.attempts, prometheus.CounterValue, float64(d.Results[r]), d.Name, r)
		}
		for _, r := range reasons {
			ch <- prometheus.MustNewConstMetric(c.recreations, prometheus.CounterValue, float64(d.Recreations[r]), d.Name, r)
		}
		ch <- prometheus.MustNewConstMetric(c.restarts, prometheus.CounterValue, float64(d.EndpointRestarts), d.Name)
		if k := d.Kubelet; k != nil {
			ch <- prometheus.MustNewConstMetric(c.kubeletDevices, prometheus.GaugeValue, float64(k.Devices), d.Name)
			ch <- prometheus.MustNewConstMetric(c.kubeletMissing, prometheus.GaugeValue, boolValue(k.Missing), d.Name)
		}
	}
	if v := c.s.env.moves.view; v != nil {
		ch <- prometheus.MustNewConstMetric(c.podResourcesUp, prometheus.GaugeValue, boolValue(v.Available()))
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
