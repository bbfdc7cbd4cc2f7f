//go:build linux

package relay

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exposes the node condition and its evidence as Prometheus metrics, read from what
// the agent last said at scrape time. Labels are bounded: the condition's type, driver names
// and types from the drivers file, and fixed results.
type Collector struct {
	r *Relay

	status, synced, writes, held, listed, missing, agentUp *prometheus.Desc
}

// NewCollector returns the collector of r; register it on a registry.
func NewCollector(r *Relay) *Collector {
	return &Collector{
		r: r,
		agentUp: prometheus.NewDesc("multireg_node_condition_agent_up",
			"1 while the node condition's agent process runs (multireg starts it again when it ends), else 0.",
			[]string{"condition"}, nil),
		status: prometheus.NewDesc("multireg_node_condition_status",
			"1 when the node condition should be True (kubelet holds every required driver, as its own records say), else 0.",
			[]string{"condition"}, nil),
		synced: prometheus.NewDesc("multireg_node_condition_synced",
			"1 when the node's Node object shows the condition multireg decided (status, reason and message), else 0: not written yet, the API server does not answer, or the write waits for the write rate.",
			[]string{"condition"}, nil),
		writes: prometheus.NewDesc("multireg_node_condition_writes_total",
			"Writes of the node condition (and of the startup taint's removal) to the API server, by result: success or error.",
			[]string{"condition", "result"}, nil),
		held: prometheus.NewDesc("multireg_driver_held",
			"1 when kubelet holds the driver as its own records say (its verdict; for a CSI driver, the node's CSINode lists it; for a device plugin, kubelet's pod-resources API holds devices of its resource), else 0. Only a required driver decides the node condition.",
			[]string{"driver", "type"}, nil),
		listed: prometheus.NewDesc("multireg_csinode_listed",
			"1 when the node's CSINode lists the CSI driver, else 0; absent until the CSINode has been read.",
			[]string{"driver"}, nil),
		missing: prometheus.NewDesc("multireg_csinode_missing",
			"1 when kubelet accepted the CSI driver over two reconcile passes ago and the node's CSINode does not list it, else 0.",
			[]string{"driver"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.status, c.synced, c.writes, c.held, c.listed, c.missing, c.agentUp} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st, agent := c.r.Status()
	ch <- prometheus.MustNewConstMetric(c.agentUp, prometheus.GaugeValue, boolValue(agent.Running), c.r.Type())
	if st.Type == "" {
		return // the agent has said nothing yet
	}
	v := st.Verdict
	ch <- prometheus.MustNewConstMetric(c.status, prometheus.GaugeValue, boolValue(v.True), st.Type)
	ch <- prometheus.MustNewConstMetric(c.synced, prometheus.GaugeValue, boolValue(st.Synced()), st.Type)
	ch <- prometheus.MustNewConstMetric(c.writes, prometheus.CounterValue, float64(st.Writes), st.Type, "success")
	ch <- prometheus.MustNewConstMetric(c.writes, prometheus.CounterValue, float64(st.WriteErrors), st.Type, "error")
	for _, e := range v.Evidence {
		ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, boolValue(e.Held), e.Driver, e.Type)
		if e.Type != "CSIPlugin" || !st.CSINode.Known {
			continue
		}
		_, ok := st.CSINode.Drivers[e.Driver]
		ch <- prometheus.MustNewConstMetric(c.listed, prometheus.GaugeValue, boolValue(ok), e.Driver)
		ch <- prometheus.MustNewConstMetric(c.missing, prometheus.GaugeValue, boolValue(e.NotListed), e.Driver)
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
