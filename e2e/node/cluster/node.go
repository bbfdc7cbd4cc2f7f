package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/node/hostpaths"
	"multireg.dev/multireg/e2e/node/images"
)

const (
	cniBinDir = "/usr/lib/cni" // Debian's containernetworking-plugins
	// deviceManagerSocket is where kubelet serves device-plugin registration, whatever its
	// --root-dir.
	deviceManagerSocket = "/var/lib/kubelet/device-plugins/kubelet.sock"
	// deviceCheckpoint is kubelet's device-plugin checkpoint, at a fixed path too.
	deviceCheckpoint = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
)

func (c *Cluster) containerdDir() string { return filepath.Join(c.opts.Dir, "containerd") }

// startContainerd starts a private containerd (own root, state and socket below Dir) whose
// CRI plugin pulls its images, the sandbox image included, from Options.Registry over plain
// HTTP (the registry's hosts.toml below its config_path), and uses Debian's CNI plugins with a
// bridge network.
func (c *Cluster) startContainerd(ctx context.Context) error {
	dir := c.containerdDir()
	cniConf := filepath.Join(c.opts.Dir, "cni")
	for _, d := range []string{dir, cniConf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	hostsDir := filepath.Join(dir, "certs.d")
	if err := images.WriteHostsDir(hostsDir, c.opts.Registry); err != nil {
		return err
	}
	// restrict_oom_score_adj: runc fails a sandbox ("can't get final child's PID from pipe")
	// where the capability bounding set lacks CAP_SYS_RESOURCE, as in some CI sandboxes,
	// unless containerd never lowers a container's OOM score below its own.
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  enable_selinux = false
  # The pods' network namespaces below the state directory, not in the host's /run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  # Where each registry's hosts.toml is: the test's registry, reached over plain HTTP.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.ContainerdAddress, c.opts.PauseImage,
		filepath.Join(dir, "runc"), cniBinDir, cniConf, hostsDir, filepath.Join(dir, "opt"))
	configPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(configPath, []byte(config), 0o644); err != nil {
		return err
	}
	cni := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": %q,
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q}]],
        "dataDir": %q
      }
    }
  ]
}
`, CNINetwork, Bridge, podCIDR, filepath.Join(c.opts.Dir, "cni-ipam"))
	if err := os.WriteFile(filepath.Join(cniConf, "10-e2e.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	if err := c.recordHostPaths(); err != nil {
		return err
	}
	if _, err := c.startProc("containerd", mustLookPath("containerd"), "--config", configPath); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := poll(wctx, 100*time.Millisecond, "containerd answering on "+c.ContainerdAddress, func() (bool, error) {
		if err := c.exitedErr("containerd"); err != nil {
			return false, err
		}
		_, err := run(wctx, "ctr", "--address", c.ContainerdAddress, "version")
		return err == nil, err
	}); err != nil {
		return err
	}
	return nil
}

func (c *Cluster) kubeletConfigPath() string { return filepath.Join(c.opts.Dir, "kubelet.yaml") }

// startKubelet writes kubelet's configuration (first start only), starts it, and waits for
// the node to be Ready with its CSINode object.
func (c *Cluster) startKubelet(ctx context.Context) error {
	if _, err := os.Stat(c.kubeletConfigPath()); errors.Is(err, fs.ErrNotExist) {
		if err := c.writeKubeletConfig(); err != nil {
			return err
		}
	}
	if err := c.recordHostPaths(); err != nil {
		return err
	}
	args := []string{
		"--config=" + c.kubeletConfigPath(),
		"--kubeconfig=" + c.kubeletKubeconfig(),
		"--root-dir=" + c.KubeletRoot,
		"--cert-dir=" + filepath.Join(c.opts.Dir, "kubelet-pki"),
		"--hostname-override=" + NodeName,
		"--v=2",
	}
	c.mu.Lock()
	if len(c.registerWithTaints) > 0 {
		// Read only when kubelet creates the Node object (RegisterNodeAgain).
		args = append(args, "--register-with-taints="+strings.Join(c.registerWithTaints, ","))
	}
	c.mu.Unlock()
	if _, err := c.startProc("kubelet", filepath.Join(c.opts.BinDir, "kubelet"), args...); err != nil {
		return err
	}
	if err := c.waitHTTP(ctx, "kubelet", fmt.Sprintf("http://127.0.0.1:%d/healthz", c.ports["kubelet-healthz"]), nil); err != nil {
		return err
	}
	return c.WaitNodeReady(ctx, time.Now(), 3*time.Minute)
}

func (c *Cluster) writeKubeletConfig() error {
	// cgroup v1 hosts (failCgroupV1: false), no QoS cgroup hierarchy nor node-allocatable
	// enforcement (the test runs without a systemd slice for kubelet), 1 s syncFrequency so
	// that ConfigMap volume updates arrive within about 1–2 s, 1 s node-status updates so
	// that device capacity shows up within seconds.
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
failCgroupV1: false
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://%s
volumePluginDir: %s
podLogsDir: %s
syncFrequency: 1s
nodeStatusUpdateFrequency: 1s
nodeStatusReportFrequency: 1s
fileCheckFrequency: 1s
serializeImagePulls: false
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%%
  imagefs.available: 1%%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: %s
authorization:
  mode: Webhook
`, c.ports["kubelet"], c.ports["kubelet-healthz"], c.ContainerdAddress,
		filepath.Join(c.opts.Dir, "volume-plugins"), filepath.Join(c.opts.Dir, "pod-logs"), c.pki.CACert)
	return os.WriteFile(c.kubeletConfigPath(), []byte(cfg), 0o644)
}

// hostFiles are the files kubelet writes at fixed paths outside its root.
var hostFiles = []string{deviceManagerSocket, deviceCheckpoint}

// recordHostPaths notes, before the components first create them, which of the fixed host
// directories (hostpaths.Absent) and hostFiles do not exist yet, so that Cleanup removes exactly those
// (directories only if empty).
func (c *Cluster) recordHostPaths() error {
	dirs := hostpaths.Absent()
	var files []string
	for _, f := range hostFiles {
		if _, err := os.Lstat(f); errors.Is(err, fs.ErrNotExist) {
			files = append(files, f)
		}
	}
	return c.state.update(func(s *state) {
		s.HostDirs = appendNew(s.HostDirs, dirs...)
		s.HostFiles = appendNew(s.HostFiles, files...)
	})
}

func appendNew(list []string, add ...string) []string {
	for _, a := range add {
		found := false
		for _, l := range list {
			found = found || l == a
		}
		if !found {
			list = append(list, a)
		}
	}
	return list
}

// WaitNodeReady waits until the node is Ready, as reported by a kubelet heartbeat in a later
// second than since (a Ready condition left by a previous kubelet does not count; heartbeat
// times have a resolution of one second), and its CSINode object exists.
func (c *Cluster) WaitNodeReady(ctx context.Context, since time.Time, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return poll(ctx, 250*time.Millisecond, "node "+NodeName+" Ready with a CSINode", func() (bool, error) {
		if err := c.exitedErr("kubelet"); err != nil {
			return false, err
		}
		node, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		ready := false
		var why string
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				fresh := cond.LastHeartbeatTime.Unix() > since.Unix()
				ready = cond.Status == corev1.ConditionTrue && fresh
				why = cond.Message
				if !fresh {
					why = "no heartbeat since " + since.Format(time.RFC3339)
				}
			}
		}
		if !ready {
			return false, fmt.Errorf("not Ready: %s", why)
		}
		if _, err := c.Client.StorageV1().CSINodes().Get(ctx, NodeName, metav1.GetOptions{}); err != nil {
			return false, err
		}
		return true, nil
	})
}

// startControllers starts kube-controller-manager (DaemonSet, service-account and
// root-CA-publisher controllers among its defaults) and kube-scheduler.
func (c *Cluster) startControllers(ctx context.Context) error {
	if _, err := c.startProc("kube-controller-manager", filepath.Join(c.opts.BinDir, "kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", c.ports["controller-manager"]),
		"--leader-elect=false",
		"--service-account-private-key-file="+c.pki.SAKey, "--root-ca-file="+c.pki.CACert,
		"--use-service-account-credentials=false",
		"--controllers="+c.flags.controllers,
	); err != nil {
		return err
	}
	if _, err := c.startProc("kube-scheduler", filepath.Join(c.opts.BinDir, "kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", c.ports["scheduler"]),
		"--leader-elect=false",
	); err != nil {
		return err
	}
	// Ready once the scheduler answers and the service-account controller made the default
	// ServiceAccounts of kube-system and default (pods are refused until they exist).
	if err := c.waitHTTP(ctx, "kube-scheduler", fmt.Sprintf("https://127.0.0.1:%d/healthz", c.ports["scheduler"]), nil); err != nil {
		return err
	}
	if err := c.waitHTTP(ctx, "kube-controller-manager", fmt.Sprintf("https://127.0.0.1:%d/healthz", c.ports["controller-manager"]), nil); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, ns := range []string{"kube-system", "default"} {
		if err := wait.Poll(wctx, 250*time.Millisecond, "ServiceAccount "+ns+"/default", func() (bool, error) {
			_, err := c.Client.CoreV1().ServiceAccounts(ns).Get(wctx, "default", metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return false, err
			}
			return err == nil, err
		}); err != nil {
			return err
		}
	}
	return nil
}

// RestartControllers stops kube-controller-manager and kube-scheduler (SIGTERM) and starts them
// again: after an outage of the API server their informers back off (client-go's reflectors,
// up to 30 s, jittered) and would notice its return only up to a minute later; started anew,
// they list at once.
func (c *Cluster) RestartControllers(ctx context.Context) error {
	for _, name := range []string{"kube-scheduler", "kube-controller-manager"} {
		if p := c.proc(name); p != nil {
			if err := p.Stop(30 * time.Second); err != nil {
				return err
			}
		}
	}
	return c.startControllers(ctx)
}

// StopKubelet stops kubelet (SIGTERM, as systemd does), leaving everything else running.
func (c *Cluster) StopKubelet() error {
	p := c.proc("kubelet")
	if p == nil {
		return errors.New("kubelet was not started")
	}
	return p.Stop(30 * time.Second)
}

// StartKubelet starts kubelet again with the same configuration and waits for the node to be
// Ready.
func (c *Cluster) StartKubelet(ctx context.Context) error {
	if p := c.proc("kubelet"); p != nil {
		if !p.Exited() {
			return errors.New("kubelet is running")
		}
	}
	return c.startKubelet(ctx)
}

// RegisterNodeAgain makes the node join the cluster anew, as a reinstalled machine does: kubelet
// stops, the Node object is deleted and the garbage collector deletes the node's CSINode (which
// the Node owns), then kubelet starts with --register-with-taints=taints (each
// KEY[=VALUE]:EFFECT; none: no such flag), creates a new Node with those taints, and is Ready
// with a new CSINode. The flag stays for kubelet's later starts, as in a node's unit file; it
// is read only when kubelet creates the Node. The node should run no pod (their containers
// would outlive the Node they were bound to until the pod garbage collector deletes them).
func (c *Cluster) RegisterNodeAgain(ctx context.Context, taints ...string) error {
	if err := c.StopKubelet(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	if err := c.Client.CoreV1().Nodes().Delete(ctx, NodeName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete the Node: %w", err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	defer wcancel()
	if err := wait.Poll(wctx, 100*time.Millisecond, "the Node and its CSINode gone", func() (bool, error) {
		_, nerr := c.Client.CoreV1().Nodes().Get(wctx, NodeName, metav1.GetOptions{})
		_, cerr := c.Client.StorageV1().CSINodes().Get(wctx, NodeName, metav1.GetOptions{})
		if apierrors.IsNotFound(nerr) && apierrors.IsNotFound(cerr) {
			return true, nil
		}
		return false, fmt.Errorf("the Node: %s; the CSINode: %s", gone(nerr), gone(cerr))
	}); err != nil {
		return err
	}
	c.mu.Lock()
	c.registerWithTaints = append([]string(nil), taints...)
	c.mu.Unlock()
	return c.startKubelet(ctx)
}

// gone says what a Get's error says of the object: gone, still there, or the error.
func gone(err error) string {
	switch {
	case err == nil:
		return "still there"
	case apierrors.IsNotFound(err):
		return "gone"
	}
	return err.Error()
}

// KubeletPID is the running kubelet's PID (0 if none).
func (c *Cluster) KubeletPID() int {
	if p := c.proc("kubelet"); p != nil {
		if !p.Exited() {
			return p.PID()
		}
	}
	return 0
}

// Kubectl runs the cluster's kubectl with the admin kubeconfig and returns its output.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.opts.BinDir, "kubectl"), append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// KubeletMetrics returns kubelet's /metrics, read from kubelet's authenticated port with the
// API server's client certificate (the API server's node proxy refuses loopback addresses,
// and this node's address is 127.0.0.1).
func (c *Cluster) KubeletMetrics(ctx context.Context) (string, error) {
	return c.KubeletGet(ctx, "/metrics")
}

// KubeletGet returns what kubelet's authenticated port answers at path (/metrics,
// /metrics/probes: its probes' counts), as KubeletMetrics reads it.
func (c *Cluster) KubeletGet(ctx context.Context, path string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d%s", c.ports["kubelet"], path), nil)
	if err != nil {
		return "", err
	}
	resp, err := c.kubeletClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("kubelet %s: %s: %s", path, resp.Status, strings.TrimSpace(string(b)))
	}
	return string(b), nil
}

// FreePort returns a TCP port of 127.0.0.1 that was free a moment ago, below the kernel's
// ephemeral range when it can: a port of that range (what listening on port 0 gives) may be
// taken by any outgoing connection of the machine before the component binds it (kubelet,
// started seconds later, once found its healthz port in use).
func FreePort() (int, error) {
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				low = n
			}
		}
	}
	const first = 20000
	for range 50 {
		if low <= first {
			break
		}
		port := first + rand.IntN(low-first)
		if l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port))); err == nil {
			l.Close()
			return port, nil
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// insecureClient checks health endpoints of components whose serving certificates are
// self-signed; it carries no credentials but the token a caller sets.
func insecureClient() *http.Client {
	return &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // health checks on 127.0.0.1
	}
}

func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	// Debian puts runc in /usr/sbin, outside a non-root PATH.
	for _, d := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: not found", name)
}

func mustLookPath(name string) string {
	p, err := lookPath(name)
	if err != nil {
		return name
	}
	return p
}
