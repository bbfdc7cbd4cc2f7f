package manifests

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// TestChartHealthChecks: healthChecks.enabled serves the drivers' liveness checks where a driver
// pod's probe reaches them, the host's network, with the container declaring no port (each would
// become a hostPort there, and the scheduler would refuse a rollout's new pod beside the old
// one), its own probes by number; off, the chart renders exactly as without the value.
func TestChartHealthChecks(t *testing.T) {
	c := loadChart(t)
	for _, tc := range []struct {
		name, values string
		httpPort     int32
		args         []string // the health flags, in order
	}{
		{"enabled", "healthChecks: {enabled: true}", 9809, []string{"--health-endpoint=:9810"}},
		{"with gRPC", "healthChecks: {enabled: true, grpcPort: 9811}", 9809, []string{"--health-endpoint=:9810", "--health-grpc-endpoint=:9811"}},
		{"other ports", "httpPort: 9000\nhealthChecks: {enabled: true, port: 9001, grpcPort: 9002}", 9000, []string{"--health-endpoint=:9001", "--health-grpc-endpoint=:9002"}},
		{"a probe's port by number", "healthChecks: {enabled: true}\nlivenessProbe: {httpGet: {path: /healthz, port: 9809}}", 9809, []string{"--health-endpoint=:9810"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			values := mustValues(t, tc.values)
			d, m := renderChartDeployment(t, c, values)
			checkDeployment(t, tc.name, m, expectations{root: kubeletRoot, healthChecks: true})
			spec := d.ds.Spec.Template.Spec
			if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
				t.Errorf("hostNetwork %v dnsPolicy %q; want true, ClusterFirstWithHostNet", spec.HostNetwork, spec.DNSPolicy)
			}
			var health []string
			for _, a := range d.container.Args {
				if strings.HasPrefix(a, "--health-") {
					health = append(health, a)
				}
			}
			if !slices.Equal(health, tc.args) {
				t.Errorf("health flags %q; want %q", health, tc.args)
			}
			if len(d.container.Ports) != 0 {
				t.Errorf("ports %+v; want none on the host's network", d.container.Ports)
			}
			port := intstr.FromInt32(tc.httpPort)
			for what, p := range map[string]*corev1.Probe{"livenessProbe": d.container.LivenessProbe, "readinessProbe": d.container.ReadinessProbe} {
				var got intstr.IntOrString
				switch {
				case p.HTTPGet != nil:
					got = p.HTTPGet.Port
				case p.TCPSocket != nil:
					got = p.TCPSocket.Port
				}
				if got != port {
					t.Errorf("%s port %s; want httpPort's number %s", what, got.String(), port.String())
				}
			}
		})
	}

	t.Run("disabled renders as without the value", func(t *testing.T) {
		def, err := renderChart(c, map[string]any{})
		if err != nil {
			t.Fatal(err)
		}
		off, err := renderChart(c, mustValues(t, "healthChecks: {enabled: false, port: 1234, grpcPort: 5678}"))
		if err != nil {
			t.Fatal(err)
		}
		if off != def {
			t.Errorf("healthChecks.enabled false renders otherwise than the defaults:\n%s", off)
		}
		d, _ := renderChartDeployment(t, c, map[string]any{})
		spec := d.ds.Spec.Template.Spec
		if spec.HostNetwork || spec.DNSPolicy != "" || len(d.container.Ports) != 1 || d.container.Ports[0].Name != "http" ||
			d.container.LivenessProbe.HTTPGet.Port != intstr.FromString("http") {
			t.Errorf("the default pod: hostNetwork %v dnsPolicy %q ports %+v liveness port %s; want the pod's network and its port http",
				spec.HostNetwork, spec.DNSPolicy, d.container.Ports, d.container.LivenessProbe.HTTPGet.Port.String())
		}
		for _, a := range d.container.Args {
			if strings.HasPrefix(a, "--health-") {
				t.Errorf("arg %q without healthChecks.enabled", a)
			}
		}
	})

	checkRenders(t, c, []renderCase{
		{"port of httpPort", "healthChecks: {enabled: true, port: 9809}", "healthChecks.port 9809 is httpPort"},
		{"gRPC port of port", "healthChecks: {enabled: true, grpcPort: 9810}", "healthChecks.grpcPort 9810 is healthChecks.port or httpPort"},
		{"gRPC port of httpPort", "healthChecks: {enabled: true, grpcPort: 9809}", "healthChecks.grpcPort 9809 is healthChecks.port or httpPort"},
		{"clashing ports, disabled", "healthChecks: {enabled: false, port: 9809, grpcPort: 9809}", ""},
		{"a probe's port by another name", "healthChecks: {enabled: true}\nreadinessProbe: {httpGet: {path: /readyz, port: metrics}}", `httpGet.port "metrics"`},
		{"port 0", "healthChecks: {enabled: true, port: 0}", "at '/healthChecks/port'"},
		{"gRPC port negative", "healthChecks: {grpcPort: -1}", "at '/healthChecks/grpcPort'"},
		{"misspelt knob", "healthChecks: {enable: true}", "additional properties 'enable' not allowed"},
		{"healthTimeout not a duration", "defaults: {healthTimeout: 3}", "at '/defaults/healthTimeout'"},
	})
}

// TestChartHealthChecksMonitoring: with healthChecks the pods declare no port, so the Service
// of the ServiceMonitor targets httpPort by number, and the PodMonitor finds it by relabeling
// the address of the one target Prometheus makes of a container without ports (the pod IP
// alone), IPv4 or IPv6.
func TestChartHealthChecksMonitoring(t *testing.T) {
	c := loadChart(t)
	render := func(values string) monitoringInstall {
		t.Helper()
		out, err := renderChart(c, mustValues(t, values))
		if err != nil {
			t.Fatal(err)
		}
		m, err := decodeMonitoring([]byte(out))
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		return m
	}

	m := render("httpPort: 9000\nhealthChecks: {enabled: true}\nmetrics: {serviceMonitor: {enabled: true}}")
	if len(m.services) != 1 || len(m.serviceMonitors) != 1 {
		t.Fatalf("%d Services, %d ServiceMonitors; want one of each", len(m.services), len(m.serviceMonitors))
	}
	if p := m.services[0].Spec.Ports; len(p) != 1 || p[0].Name != "http" || p[0].Port != 9000 || p[0].TargetPort != intstr.FromInt32(9000) {
		t.Errorf("Service ports %+v; want http, 9000, to the pods' port 9000 by number", p)
	}
	if e := m.serviceMonitors[0].Spec.Endpoints; len(e) != 1 || e[0].Port != "http" {
		t.Errorf("ServiceMonitor endpoints %+v; want the Service's port http", e)
	}

	user := monitoringv1.RelabelConfig{Action: "labeldrop", Regex: "pod_template_hash"}
	m = render("httpPort: 9000\nhealthChecks: {enabled: true}\nmetrics: {podMonitor: {enabled: true, relabelings: [{action: labeldrop, regex: pod_template_hash}]}}")
	if len(m.podMonitors) != 1 || len(m.podMonitors[0].Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("%d PodMonitors; want one, with one endpoint", len(m.podMonitors))
	}
	e := m.podMonitors[0].Spec.PodMetricsEndpoints[0]
	if e.Port != nil || e.PortNumber != nil || e.TargetPort != nil { //nolint:staticcheck // TargetPort: that no deprecated field selects a port either
		t.Errorf("PodMonitor endpoint port %v portNumber %v targetPort %v: each keeps only the targets of a declared port, and the pods declare none", e.Port, e.PortNumber, e.TargetPort) //nolint:staticcheck
	}
	r := e.RelabelConfigs
	if len(r) != 5 || !relabelEqual(r[0], nodeRelabeling) || !relabelEqual(r[4], user) {
		t.Fatalf("relabelings %+v; want the node's, the address's three, the values' one", r)
	}
	for _, tt := range []struct {
		container, address, want string // want "" when dropped
	}{
		{"multireg", "10.1.2.3", "10.1.2.3:9000"},
		{"multireg", "fd00::1:2", "[fd00::1:2]:9000"},
		{"sidecar", "10.1.2.3", ""},
	} {
		labels := map[string]string{"__address__": tt.address, "__meta_kubernetes_pod_container_name": tt.container}
		kept := true
		for _, rc := range r[1:4] {
			if kept = applyRelabel(t, rc, labels); !kept {
				break
			}
		}
		switch {
		case !kept && tt.want != "":
			t.Errorf("container %s at %s: dropped; want %s", tt.container, tt.address, tt.want)
		case kept && tt.want == "":
			t.Errorf("container %s at %s: kept as %s; want it dropped", tt.container, tt.address, labels["__address__"])
		case kept && labels["__address__"] != tt.want:
			t.Errorf("container %s at %s: address %s; want %s", tt.container, tt.address, labels["__address__"], tt.want)
		}
	}

	// Without healthChecks the PodMonitor keeps its port http and the node's relabeling alone.
	m = render("metrics: {podMonitor: {enabled: true}}")
	if e := m.podMonitors[0].Spec.PodMetricsEndpoints[0]; e.Port == nil || *e.Port != "http" || len(e.RelabelConfigs) != 1 {
		t.Errorf("PodMonitor endpoint without healthChecks: port %v, %d relabelings; want http and the node's", e.Port, len(e.RelabelConfigs))
	}
}

func relabelEqual(a, b monitoringv1.RelabelConfig) bool {
	return a.Action == b.Action && slices.Equal(a.SourceLabels, b.SourceLabels) && a.TargetLabel == b.TargetLabel &&
		a.Regex == b.Regex && ((a.Replacement == nil) == (b.Replacement == nil)) && (a.Replacement == nil || *a.Replacement == *b.Replacement)
}

// applyRelabel applies a keep or replace relabeling to labels as Prometheus does (the source
// labels joined by ";", the regex anchored at both ends, $1 or ${1} expanded in the
// replacement), and reports whether the target is kept.
func applyRelabel(t *testing.T, rc monitoringv1.RelabelConfig, labels map[string]string) bool {
	t.Helper()
	var vals []string
	for _, l := range rc.SourceLabels {
		vals = append(vals, labels[string(l)])
	}
	val := strings.Join(vals, ";")
	regex := rc.Regex
	if regex == "" {
		regex = "(.*)"
	}
	re := regexp.MustCompile("^(?s:" + regex + ")$")
	switch strings.ToLower(rc.Action) {
	case "keep":
		return re.MatchString(val)
	case "replace", "":
		idx := re.FindStringSubmatchIndex(val)
		if idx == nil {
			return true
		}
		repl := "$1"
		if rc.Replacement != nil {
			repl = *rc.Replacement
		}
		labels[rc.TargetLabel] = string(re.ExpandString(nil, repl, val, idx))
		return true
	}
	t.Fatalf("relabeling action %q: not simulated here", rc.Action)
	return false
}
