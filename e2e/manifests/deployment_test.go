package manifests

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const (
	containerName    = "multireg"
	defaultRegDir    = "/var/lib/kubelet/plugins_registry" // multireg's default registrationDir
	checksumConfig   = "checksum/config"
	healthzPath      = "/healthz"
	readyzPath       = "/readyz"
	criticalPriority = "system-node-critical"
)

// deployment is one way of running multireg: its DaemonSet, the ConfigMap holding its drivers
// file, and the drivers file's path and content as multireg sees them.
type deployment struct {
	ds         *appsv1.DaemonSet
	cm         *corev1.ConfigMap
	container  *corev1.Container
	configPath string // --config
	config     []byte // the ConfigMap entry --config names
}

// deploymentOf finds the DaemonSet, its multireg container, the drivers file its --config names
// and the ConfigMap that file comes from.
func deploymentOf(m manifests) (*deployment, error) {
	if len(m.daemonSets) != 1 || len(m.configMaps) != 1 {
		return nil, fmt.Errorf("%d DaemonSets and %d ConfigMaps; want one of each", len(m.daemonSets), len(m.configMaps))
	}
	d := &deployment{ds: m.daemonSets[0], cm: m.configMaps[0]}
	spec := &d.ds.Spec.Template.Spec
	for i := range spec.Containers {
		if spec.Containers[i].Name == containerName {
			d.container = &spec.Containers[i]
		}
	}
	if d.container == nil {
		return nil, fmt.Errorf("no container %q", containerName)
	}
	var ok bool
	d.configPath, ok = flagValue(d.container.Args, "config")
	if !ok {
		return nil, fmt.Errorf("args %q: no --config", d.container.Args)
	}
	return d, nil
}

// flagValue returns the value of a Go flag in args: -name=v, --name=v, -name v or --name v.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		for _, p := range []string{"-" + name, "--" + name} {
			if a == p && i+1 < len(args) {
				return args[i+1], true
			}
			if v, ok := strings.CutPrefix(a, p+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

// driversFile is what the mount checks read of a drivers file (multireg validates the rest).
type driversFile struct {
	RegistrationDir string `json:"registrationDir"`
	Drivers         []struct {
		Name          string `json:"name"`
		Endpoint      string `json:"endpoint"`
		LocalEndpoint string `json:"localEndpoint"`
	} `json:"drivers"`
}

// under reports whether p is dir or lies below it.
func under(p, dir string) bool {
	p, dir = path.Clean(p), path.Clean(dir)
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// expectations are what differs between deployments.
type expectations struct {
	root               string // every host path lies under it
	rollOnConfigChange bool   // the pod template carries checksum/config
	// noSurge: the documented alternative update strategy, old pod first (maxUnavailable 1,
	// maxSurge 0). Otherwise the shipped one: new pod first (maxSurge 1, maxUnavailable 0),
	// which hands the sockets over.
	noSurge bool
	// healthChecks: the drivers' health checks are served (--health-endpoint), on the host's
	// network, where kubelet's probes of the driver pods reach them: hostNetwork with its DNS
	// policy, and no container port (on the host's network each would be a host port).
	healthChecks bool
}

// problems checks the deployment against the contract of DESIGN.md and the issue that shipped
// it: paths in the drivers file agree with the mounts, the ConfigMap is mounted so that edits
// reach multireg, probes, privileges and the update strategy. It returns one line per problem.
func (d *deployment) problems(want expectations) []string {
	var probs []string
	add := func(format string, args ...any) { probs = append(probs, fmt.Sprintf(format, args...)) }
	spec := &d.ds.Spec.Template.Spec
	volumes := map[string]*corev1.Volume{}
	for i := range spec.Volumes {
		volumes[spec.Volumes[i].Name] = &spec.Volumes[i]
	}

	// The drivers file: in the ConfigMap volume, mounted as a directory.
	var configMount *corev1.VolumeMount
	for i, m := range d.container.VolumeMounts {
		if v := volumes[m.Name]; v != nil && v.ConfigMap != nil && under(d.configPath, m.MountPath) {
			configMount = &d.container.VolumeMounts[i]
		}
	}
	switch {
	case configMount == nil:
		add("--config %s: not in a ConfigMap volume", d.configPath)
	case configMount.SubPath != "" || configMount.SubPathExpr != "":
		add("ConfigMap mount %s: subPath: kubelet never updates it, so edits would never reach multireg", configMount.MountPath)
	default:
		v := volumes[configMount.Name].ConfigMap
		key, _ := filepath.Rel(configMount.MountPath, d.configPath)
		for _, item := range v.Items {
			if item.Path == key {
				key = item.Key
			}
		}
		switch {
		case v.Name != d.cm.Name:
			add("ConfigMap volume %q names ConfigMap %q; the ConfigMap shipped is %q", configMount.Name, v.Name, d.cm.Name)
		case d.cm.Data[key] == "":
			add("--config %s: ConfigMap %s has no key %q", d.configPath, d.cm.Name, key)
		default:
			d.config = []byte(d.cm.Data[key])
		}
	}

	// Every path multireg uses is a host path mounted at the same path inside.
	var cfg driversFile
	if d.config != nil {
		if err := yaml.Unmarshal(d.config, &cfg); err != nil {
			add("drivers file: %v", err)
		}
	}
	if cfg.RegistrationDir == "" {
		cfg.RegistrationDir = defaultRegDir
	}
	// mountOf returns the same-path hostPath mount that holds p, or a problem.
	mountOf := func(field, p string) *corev1.VolumeMount {
		var found *corev1.VolumeMount
		for i, m := range d.container.VolumeMounts {
			v := volumes[m.Name]
			if v == nil || v.HostPath == nil || !under(p, m.MountPath) {
				continue
			}
			if path.Clean(v.HostPath.Path) != path.Clean(m.MountPath) {
				add("%s %s: volume %q mounts host path %s at %s: not the same path, so kubelet and multireg would not agree", field, p, m.Name, v.HostPath.Path, m.MountPath)
				return nil
			}
			if m.SubPath != "" || m.SubPathExpr != "" {
				add("%s %s: mount %s has a subPath", field, p, m.MountPath)
				return nil
			}
			if found == nil || len(m.MountPath) > len(found.MountPath) {
				found = &d.container.VolumeMounts[i]
			}
		}
		if found == nil {
			add("%s %s: not under any host directory mounted at its own path", field, p)
		}
		return found
	}
	if m := mountOf("registrationDir", cfg.RegistrationDir); m != nil && m.ReadOnly {
		add("registrationDir %s: mount %s is read-only; multireg creates its sockets there", cfg.RegistrationDir, m.MountPath)
	}
	for i, drv := range cfg.Drivers {
		mountOf(fmt.Sprintf("drivers[%d].endpoint", i), drv.Endpoint)
		if drv.LocalEndpoint != "" {
			mountOf(fmt.Sprintf("drivers[%d].localEndpoint", i), drv.LocalEndpoint)
		}
	}
	if want.root != "" {
		paths := []string{cfg.RegistrationDir}
		for _, drv := range cfg.Drivers {
			paths = append(paths, drv.Endpoint, drv.LocalEndpoint)
		}
		for _, v := range spec.Volumes {
			if v.HostPath != nil {
				paths = append(paths, v.HostPath.Path)
			}
		}
		for _, p := range paths {
			if p != "" && !under(p, want.root) {
				add("%s: not under the kubelet root %s", p, want.root)
			}
		}
	}

	// Probes reach the HTTP server through the pod IP.
	endpoint, ok := flagValue(d.container.Args, "http-endpoint")
	host, port, err := net.SplitHostPort(endpoint)
	switch {
	case !ok:
		add("no --http-endpoint: multireg's default, 127.0.0.1:9809, is out of the kubelet's reach")
	case err != nil:
		add("--http-endpoint %q: %v", endpoint, err)
	case host != "" && host != "0.0.0.0" && host != "::":
		add("--http-endpoint %q: kubelet's probes come to the pod IP; listen on all interfaces (\":%s\")", endpoint, port)
	}
	for _, p := range []struct {
		name, path string
		probe      *corev1.Probe
	}{{"livenessProbe", healthzPath, d.container.LivenessProbe}, {"readinessProbe", readyzPath, d.container.ReadinessProbe}} {
		switch {
		case p.probe == nil || p.probe.HTTPGet == nil:
			add("%s: want an httpGet on %s", p.name, p.path)
		case p.probe.HTTPGet.Path != p.path:
			add("%s: path %s; want %s", p.name, p.probe.HTTPGet.Path, p.path)
		default:
			if got := d.containerPort(p.probe.HTTPGet.Port.String()); got != port {
				add("%s: port %s is %q; multireg listens on %q", p.name, p.probe.HTTPGet.Port.String(), got, port)
			}
		}
	}

	// Arguments.
	if len(d.container.Args) == 0 || d.container.Args[0] != "run" {
		add("args %q: want `run` first", d.container.Args)
	}
	if f, _ := flagValue(d.container.Args, "log-format"); f != "json" {
		add("--log-format %q; want json", f)
	}

	// Privileges: root, and nothing else.
	sc := d.container.SecurityContext
	switch {
	case sc == nil:
		add("no securityContext")
	default:
		if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
			add("runAsUser: want 0 (kubelet's plugins-registry directory is root's)")
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			add("readOnlyRootFilesystem: want true")
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			add("allowPrivilegeEscalation: want false")
		}
		if sc.Privileged != nil && *sc.Privileged {
			add("privileged: want false")
		}
		if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
			add("capabilities: want drop [ALL] and no add, got %+v", sc.Capabilities)
		}
	}
	health, served := flagValue(d.container.Args, "health-endpoint")
	switch {
	case want.healthChecks:
		if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
			add("hostNetwork %v, dnsPolicy %q: the health checks need the host's network (kubelet probes a driver pod from the node) and ClusterFirstWithHostNet", spec.HostNetwork, spec.DNSPolicy)
		}
		if h, _, err := net.SplitHostPort(health); !served || err != nil || h != "" {
			add("--health-endpoint %q: want \":PORT\", every address of the node, where kubelet probes a host-network driver pod", health)
		}
		for _, c := range spec.Containers {
			if len(c.Ports) > 0 {
				add("container %s: ports %v on the host's network: each becomes a hostPort (SetDefaults_Pod), and the scheduler refuses a rollout's new pod beside the old one", c.Name, c.Ports)
			}
		}
	case spec.HostNetwork:
		add("hostNetwork: multireg needs only host-path sockets, and its port would collide with node agents (and, during a surge, with the other multireg pod of the node)")
	case served:
		add("--health-endpoint %q without the host's network: no driver pod's probe reaches the pod's own network", health)
	}
	if spec.PriorityClassName != criticalPriority {
		add("priorityClassName %q; want %s", spec.PriorityClassName, criticalPriority)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(t corev1.Toleration) bool {
		return t.Operator == corev1.TolerationOpExists && t.Key == "" && t.Effect == ""
	}) {
		add("tolerations %+v: want one that tolerates every taint (operator: Exists)", spec.Tolerations)
	}
	r := d.container.Resources
	if r.Requests.Cpu().IsZero() || r.Requests.Memory().IsZero() || r.Limits.Memory().IsZero() {
		add("resources %+v: want cpu and memory requests and a memory limit", r)
	}

	// Rolling update: new pod first, so that the old one hands its sockets over (or, the
	// documented alternative, old pod first). During a surge two pods of the DaemonSet run on
	// a node: nothing of theirs but the host directories may collide.
	surge, unavailable := rollingUpdate(d.ds.Spec.UpdateStrategy)
	wantSurge, wantUnavailable := "1", "0"
	if want.noSurge {
		wantSurge, wantUnavailable = "0", "1"
	}
	if s := d.ds.Spec.UpdateStrategy; s.Type != appsv1.RollingUpdateDaemonSetStrategyType || surge != wantSurge || unavailable != wantUnavailable {
		add("updateStrategy %s maxSurge %s maxUnavailable %s; want RollingUpdate maxSurge %s maxUnavailable %s (new pod first: the old one hands its sockets over)",
			s.Type, surge, unavailable, wantSurge, wantUnavailable)
	}
	if surge != "0" && surge != "0%" {
		for _, c := range spec.Containers {
			for _, p := range c.Ports {
				// On the host's network the API server defaults hostPort to containerPort.
				if hp := p.HostPort; hp != 0 || spec.HostNetwork {
					if hp == 0 {
						hp = p.ContainerPort
					}
					add("container %s port %d: hostPort %d with maxSurge %s: the new pod cannot be scheduled beside the old one, which holds the host port, and the rollout stops", c.Name, p.ContainerPort, hp, surge)
				}
			}
		}
	}
	if _, ok := d.ds.Spec.Template.Annotations[checksumConfig]; ok != want.rollOnConfigChange {
		add("pod annotation %s present: %v; want %v (a ConfigMap edit must not restart multireg unless asked)", checksumConfig, ok, want.rollOnConfigChange)
	}

	// The selector selects the pods.
	if sel := d.ds.Spec.Selector; sel == nil || len(sel.MatchLabels) == 0 ||
		!labels.SelectorFromSet(sel.MatchLabels).Matches(labels.Set(d.ds.Spec.Template.Labels)) {
		add("selector %v does not select the pod labels %v", d.ds.Spec.Selector, d.ds.Spec.Template.Labels)
	}
	return probs
}

// rollingUpdate returns a DaemonSet's maxSurge and maxUnavailable, with the API server's
// defaults for those not set (0 and 1).
func rollingUpdate(s appsv1.DaemonSetUpdateStrategy) (maxSurge, maxUnavailable string) {
	maxSurge, maxUnavailable = "0", "1"
	if r := s.RollingUpdate; r != nil {
		if r.MaxSurge != nil {
			maxSurge = r.MaxSurge.String()
		}
		if r.MaxUnavailable != nil {
			maxUnavailable = r.MaxUnavailable.String()
		}
	}
	return maxSurge, maxUnavailable
}

// containerPort resolves a probe's port (a number or a port name) to a port number: a name by
// the container's ports; a number is the port, declared or not (kubelet probes it as it is).
func (d *deployment) containerPort(p string) string {
	for _, cp := range d.container.Ports {
		if cp.Name == p || strconv.Itoa(int(cp.ContainerPort)) == p {
			return strconv.Itoa(int(cp.ContainerPort))
		}
	}
	if n, err := strconv.Atoi(p); err == nil && n > 0 && n < 65536 {
		return p
	}
	return ""
}

// validate runs `multireg validate` on a drivers file; name is the file's name in messages.
func validate(t testing.TB, name string, content []byte) error {
	t.Helper()
	file := filepath.Join(t.TempDir(), filepath.Base(name))
	if err := os.WriteFile(file, content, 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(binary(t), "validate", "--config", file).CombinedOutput()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return fmt.Errorf("%s: multireg validate exit %d:\n%s", name, exit.ExitCode(), out)
	case err != nil:
		t.Fatal(err)
	}
	return nil
}

// checkArgs asks multireg whether it accepts a container's arguments: the same command line
// with -h appended parses every flag and then prints the help (exit 0) instead of running. An
// unknown flag, a bad value or a stray argument exits 2.
func checkArgs(t testing.TB, args []string) error {
	t.Helper()
	out, err := exec.Command(binary(t), append(slices.Clone(args), "-h")...).CombinedOutput()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return fmt.Errorf("multireg rejects the container's args %q (exit %d):\n%s", args, exit.ExitCode(), out)
	case err != nil:
		t.Fatal(err)
	}
	return nil
}

// sampleNodeName stands for the node's name where the downward API gives it (spec.nodeName).
const sampleNodeName = "node-a"

// expandArgs returns a container's arguments as kubelet passes them: each $(VAR) of the
// container's env replaced by its value ($$ is a literal $), the node's name by sampleNodeName;
// a reference to a variable that is not defined stays as it is.
func expandArgs(c *corev1.Container) []string {
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
			env[e.Name] = sampleNodeName
		}
	}
	out := make([]string, len(c.Args))
	for i, a := range c.Args {
		var b strings.Builder
		for j := 0; j < len(a); j++ {
			if a[j] != '$' || j+1 == len(a) {
				b.WriteByte(a[j])
				continue
			}
			switch a[j+1] {
			case '$':
				b.WriteByte('$')
				j++
				continue
			case '(':
				if end := strings.IndexByte(a[j:], ')'); end > 0 {
					if v, ok := env[a[j+2:j+end]]; ok {
						b.WriteString(v)
						j += end
						continue
					}
				}
			}
			b.WriteByte(a[j])
		}
		out[i] = b.String()
	}
	return out
}

func TestExpandArgs(t *testing.T) {
	c := &corev1.Container{
		Args: []string{"--node-name=$(NODE_NAME)", "$$(NODE_NAME)", "$(UNSET)", "$(A)-$(A)", "a$", "$", "$(NODE_NAME"},
		Env: []corev1.EnvVar{
			{Name: "NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
			{Name: "A", Value: "x"},
		},
	}
	want := []string{"--node-name=" + sampleNodeName, "$(NODE_NAME)", "$(UNSET)", "x-x", "a$", "$", "$(NODE_NAME"}
	if got := expandArgs(c); !slices.Equal(got, want) {
		t.Errorf("expandArgs = %q; want %q", got, want)
	}
}

// checkDeployment runs every check on the objects of one install, including multireg's own
// validation of the drivers file and of the container's command line.
func checkDeployment(t *testing.T, name string, m manifests, want expectations) *deployment {
	t.Helper()
	d, err := deploymentOf(m)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	for _, p := range d.problems(want) {
		t.Errorf("%s: %s", name, p)
	}
	if err := checkArgs(t, expandArgs(d.container)); err != nil {
		t.Errorf("%s: %v", name, err)
	}
	if d.config == nil {
		t.Fatalf("%s: no drivers file", name)
	}
	if err := validate(t, name+": "+d.configPath, d.config); err != nil {
		t.Error(err)
	}
	return d
}
