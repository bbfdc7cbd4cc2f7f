package reload

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exposes the outcome of the reloads as Prometheus metrics, read at scrape time.
type Collector struct {
	r *Reloader

	successful, successTime, generation *prometheus.Desc
}

// NewCollector returns the collector of r; register it on a registry.
func NewCollector(r *Reloader) *Collector {
	return &Collector{
		r: r,
		successful: prometheus.NewDesc("multireg_config_last_reload_successful",
			"1 when the drivers file on disk is the configuration in force, 0 when the last read found it unreadable or invalid, or could not apply it.",
			nil, nil),
		successTime: prometheus.NewDesc("multireg_config_last_reload_success_timestamp_seconds",
			"When a configuration was last applied, in seconds since the epoch.",
			nil, nil),
		generation: prometheus.NewDesc("multireg_config_generation",
			"How many configurations have been applied; the first is 1.",
			nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.successful
	ch <- c.successTime
	ch <- c.generation
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st := c.r.State()
	ok := 0.0
	if st.LastReloadSuccessful {
		ok = 1
	}
	ch <- prometheus.MustNewConstMetric(c.successful, prometheus.GaugeValue, ok)
	var ts float64
	if !st.LastSuccessTime.IsZero() {
		ts = float64(st.LastSuccessTime.UnixNano()) / 1e9
	}
	ch <- prometheus.MustNewConstMetric(c.successTime, prometheus.GaugeValue, ts)
	ch <- prometheus.MustNewConstMetric(c.generation, prometheus.GaugeValue, float64(st.Generation))
}
