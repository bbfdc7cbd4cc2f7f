// Package cluster brings up a single-node Kubernetes on this machine for multireg's node
// end-to-end test: etcd and containerd from the distribution's packages, kube-apiserver,
// kube-controller-manager, kube-scheduler and kubelet built from source (build-kube.sh),
// everything on 127.0.0.1 or unix sockets below one short directory, and tears it down again
// — processes by PID, mounts, the network bridge, the sysctls kubelet changes — even after a
// failure (Cleanup, cmd/cleanup).
package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"multireg.dev/multireg/e2e/internal/controlplane"
	"multireg.dev/multireg/e2e/internal/wait"
)

// NodeName is the node's name. kubelet refuses a loopback node IP, so the API server reaches
// kubelet by this host name (--kubelet-preferred-address-types=Hostname,…): `kubectl logs`,
// `exec` and the node proxy then work on 127.0.0.1.
const NodeName = "localhost"

// Options configure Start.
type Options struct {
	// Dir is the cluster's directory: short (unix socket paths below it must stay under 108
	// bytes), existing, and holding no cluster's state yet. Everything the cluster writes goes there but for the few
	// files kubelet writes at fixed paths (see Cleanup).
	Dir string
	// BinDir holds kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl.
	BinDir string
	// Registry is the HOST:PORT of the plain-HTTP registry containerd pulls the images from
	// (images.Registry): containerd's registry configuration names it (images.WriteHostsDir).
	Registry string
	// PauseImage is the sandbox image's reference, pulled from Registry like every image.
	PauseImage string
	// Log receives a line per step.
	Log io.Writer
	// RegisterWithTaints are the taints kubelet registers the node with
	// (--register-with-taints), each KEY[=VALUE]:EFFECT; none: kubelet gets no such flag.
	// RegisterNodeAgain sets them anew.
	RegisterWithTaints []string
}

// Cluster is a running single-node cluster.
type Cluster struct {
	mu      sync.Mutex // guards procs and stopped: Stop may run on a signal mid-test
	stopped bool
	// Stop tears down once; a second call (a signal during the teardown) waits for it.
	stopOnce sync.Once
	stopErr  error

	opts   Options
	flags  releaseFlags
	pki    *controlplane.PKI
	state  *stateStore
	procs  map[string]*proc
	phases []Phase
	// door forwards the pods' connections to the API server (PodAPIServer).
	door door
	// registerWithTaints are kubelet's --register-with-taints (Options.RegisterWithTaints,
	// RegisterNodeAgain); guarded by mu.
	registerWithTaints []string

	// Version is the release of the binaries (their --version); the flags that differ
	// between releases follow it (flagsFor).
	Version Version
	Client  kubernetes.Interface
	// Kubeconfig is an admin kubeconfig (for kubectl).
	Kubeconfig string
	// KubeletRoot is kubelet's --root-dir; PluginsRegistry and PluginsDir are below it.
	KubeletRoot, PluginsRegistry, PluginsDir string
	// ContainerdAddress is containerd's socket.
	ContainerdAddress string
	apiServerURL      string
	ports             map[string]int
	// kubeletClient reads kubelet's metrics with the API server's client certificate.
	kubeletClient *http.Client
}

// Phase is a step of the cluster's life and how long it took.
type Phase struct {
	Name     string
	Duration time.Duration
}

// Bridge is the CNI bridge of the pods' network, CNINetwork its name (which also names the
// CNI results containerd caches outside the cluster's directory).
const (
	Bridge     = "mrn0"
	CNINetwork = "mrn-e2e"
)

// podCIDR must not collide with the host's networks; Start checks it does not.
const podCIDR = "10.88.77.0/24"

// Start brings the cluster up to a Ready node with a CSINode object. On error everything it
// started is torn down again.
func Start(ctx context.Context, opts Options) (c *Cluster, err error) {
	if os.Geteuid() != 0 {
		return nil, errNotRoot
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if opts.Dir == "" {
		return nil, errors.New("cluster: Options.Dir is empty")
	}
	if abs, err := filepath.Abs(opts.Dir); err == nil {
		opts.Dir = abs
	}
	if _, err := os.Stat(filepath.Join(opts.Dir, stateFile)); err == nil {
		// Refused before anything starts: a teardown would undo the other run's state.
		return nil, fmt.Errorf("%s holds a cluster's state already (running, or left over: go run ./cmd/cleanup %s)", opts.Dir, opts.Dir)
	}
	if opts.Registry == "" || opts.PauseImage == "" {
		return nil, fmt.Errorf("cluster: Options.Registry (%q) and Options.PauseImage (%q) are required: containerd pulls every image, the sandbox image too", opts.Registry, opts.PauseImage)
	}
	c = &Cluster{
		opts:               opts,
		registerWithTaints: opts.RegisterWithTaints,
		state:              newStateStore(opts.Dir),
		procs:              map[string]*proc{},
		Kubeconfig:         filepath.Join(opts.Dir, "admin.kubeconfig"),
		KubeletRoot:        filepath.Join(opts.Dir, "kubelet"),
		ContainerdAddress:  filepath.Join(opts.Dir, "containerd", "c.sock"),
		ports:              map[string]int{},
	}
	c.PluginsRegistry = filepath.Join(c.KubeletRoot, "plugins_registry")
	c.PluginsDir = filepath.Join(c.KubeletRoot, "plugins")
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, c.Logs(20))
			if serr := c.Stop(); serr != nil {
				err = fmt.Errorf("%w\nteardown: %v", err, serr)
			}
			c = nil
		}
	}()
	if err := c.preflight(); err != nil {
		return c, err
	}
	for _, dir := range []string{c.logDir(), c.KubeletRoot} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return c, err
		}
	}
	taken := map[int]bool{}
	for _, name := range []string{"etcd", "etcd-peer", "apiserver", "kubelet", "kubelet-healthz", "controller-manager", "scheduler"} {
		for c.ports[name] == 0 || taken[c.ports[name]] { // each its own
			if c.ports[name], err = FreePort(); err != nil {
				return c, err
			}
		}
		taken[c.ports[name]] = true
	}
	c.apiServerURL = fmt.Sprintf("https://127.0.0.1:%d", c.ports["apiserver"])

	steps := []struct {
		name string
		f    func(context.Context) error
	}{
		{"certificates (openssl)", c.makePKI},
		{"etcd", c.startEtcd},
		{"kube-apiserver", c.startAPIServer},
		{"pods' bridge + their door to the API server", c.openPodNetwork},
		{"containerd", c.startContainerd},
		{"kubelet → node Ready", c.startKubelet},
		{"controller-manager + scheduler", c.startControllers},
	}
	for _, s := range steps {
		if err := c.Phase(s.name, func() error { return s.f(ctx) }); err != nil {
			return c, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return c, nil
}

// Phase runs f as a named, timed phase of the cluster's life.
func (c *Cluster) Phase(name string, f func() error) error {
	return TimePhase(c.opts.Log, &c.phases, name, f)
}

// TimePhase runs f, appends its name and duration to phases, and writes a line to log when
// it starts and when it ends.
func TimePhase(log io.Writer, phases *[]Phase, name string, f func() error) error {
	start := time.Now()
	fmt.Fprintf(log, "=== %s …\n", name)
	err := f()
	d := time.Since(start)
	*phases = append(*phases, Phase{Name: name, Duration: d})
	if err != nil {
		fmt.Fprintf(log, "=== %s: FAILED after %s: %v\n", name, d.Round(time.Millisecond), err)
	} else {
		fmt.Fprintf(log, "=== %s: %s\n", name, d.Round(time.Millisecond))
	}
	return err
}

// Phases returns the phases so far, in order.
func (c *Cluster) Phases() []Phase { return append([]Phase(nil), c.phases...) }

// Dir is the cluster's directory; a test may keep its own files below it (they go with it,
// even when the test binary dies).
func (c *Cluster) Dir() string { return c.opts.Dir }

func (c *Cluster) logDir() string { return filepath.Join(c.opts.Dir, "logs") }

// Logs returns the last n lines of every component's log, for a failure report.
func (c *Cluster) Logs(n int) string {
	var b strings.Builder
	for _, name := range []string{"etcd", "kube-apiserver", "containerd", "kubelet", "kube-controller-manager", "kube-scheduler"} {
		p := filepath.Join(c.logDir(), name+".log")
		if _, err := os.Stat(p); err != nil {
			continue
		}
		fmt.Fprintf(&b, "----- last %d lines of %s -----\n%s\n", n, p, Tail(p, n))
	}
	return b.String()
}

// LogPath is the log file of a component (kubelet, containerd, …).
func (c *Cluster) LogPath(name string) string { return filepath.Join(c.logDir(), name+".log") }

func (c *Cluster) preflight() error {
	var missing []string
	for _, b := range []string{"etcd", "containerd", "ctr", "runc", "openssl", "ip", "mount"} {
		if _, err := lookPath(b); err != nil {
			missing = append(missing, b)
		}
	}
	for _, b := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl"} {
		if _, err := os.Stat(filepath.Join(c.opts.BinDir, b)); err != nil {
			missing = append(missing, filepath.Join(c.opts.BinDir, b))
		}
	}
	for _, b := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat(filepath.Join(cniBinDir, b)); err != nil {
			missing = append(missing, filepath.Join(cniBinDir, b))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing: %s (make e2e-node installs the packages: etcd-server containerd containernetworking-plugins openssl iproute2)", strings.Join(missing, ", "))
	}
	v, err := binariesVersion(c.opts.BinDir)
	if err != nil {
		return err
	}
	c.Version, c.flags = v, flagsFor(v)
	fmt.Fprintf(c.opts.Log, "=== Kubernetes %s (%s)\n", v, c.opts.BinDir)
	// kubelet always serves its device-plugin registration socket at this fixed path and
	// deletes every socket in its directory at start: a kubelet of this host would lose its
	// device plugins.
	if conn, err := net.Dial("unix", deviceManagerSocket); err == nil {
		conn.Close()
		return fmt.Errorf("a kubelet already runs on this machine (%s answers); the test cluster would take over its device-plugin directory", deviceManagerSocket)
	}
	// …and a stopped kubelet's device plugins would lose their sockets and checkpoint.
	if ents, err := os.ReadDir(filepath.Dir(deviceManagerSocket)); err == nil && len(ents) > 0 {
		return fmt.Errorf("%s is not empty: a kubelet of this machine keeps its device plugins there, and the test's kubelet would delete their sockets and overwrite its checkpoint", filepath.Dir(deviceManagerSocket))
	}
	if _, err := os.Stat("/sys/class/net/" + Bridge); err == nil {
		return fmt.Errorf("network interface %s exists already (a test cluster still running, or left over: go run ./cmd/cleanup DIR)", Bridge)
	}
	if out, err := runFor(10*time.Second, "ip", "-4", "route", "show", "to", "match", "10.88.77.1"); err == nil && strings.Contains(out, "10.88.77") {
		return fmt.Errorf("the pods' network %s overlaps a route of this host: %s", podCIDR, strings.TrimSpace(out))
	}
	sysctls, err := readSysctls()
	if err != nil {
		return err
	}
	return c.state.update(func(s *state) {
		s.Sysctls = sysctls
		s.Bridge = Bridge
		s.CNINetwork = CNINetwork
		s.ContainerdAddress = c.ContainerdAddress
	})
}

func (c *Cluster) makePKI(ctx context.Context) (err error) {
	// The pods reach the API server at PodAPIHost (podapi.go): its certificate names it.
	c.pki, err = controlplane.MakePKI(ctx, filepath.Join(c.opts.Dir, "pki"), NodeName, "IP:"+PodAPIHost)
	if err != nil {
		return err
	}
	cert, err := tls.LoadX509KeyPair(c.pki.KubeletClientCert, c.pki.KubeletClientKey)
	if err != nil {
		return err
	}
	c.kubeletClient = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		Certificates:       []tls.Certificate{cert},
		InsecureSkipVerify: true, //nolint:gosec // kubelet's self-signed serving certificate, on 127.0.0.1
	}}}
	if err := controlplane.WriteKubeconfig(c.Kubeconfig, c.apiServerURL, c.pki.CACert, c.pki.AdminToken); err != nil {
		return err
	}
	return controlplane.WriteKubeconfig(c.kubeletKubeconfig(), c.apiServerURL, c.pki.CACert, c.pki.KubeletToken)
}

func (c *Cluster) kubeletKubeconfig() string { return filepath.Join(c.opts.Dir, "kubelet.kubeconfig") }

func (c *Cluster) startEtcd(ctx context.Context) error {
	client := fmt.Sprintf("http://127.0.0.1:%d", c.ports["etcd"])
	if _, err := c.startProc("etcd", mustLookPath("etcd"),
		controlplane.EtcdArgs(filepath.Join(c.opts.Dir, "etcd"), c.ports["etcd"], c.ports["etcd-peer"])...); err != nil {
		return err
	}
	return c.waitHTTP(ctx, "etcd", client+"/health", nil)
}

func (c *Cluster) startAPIServer(ctx context.Context) error {
	p := c.pki
	if _, err := c.startProc("kube-apiserver", filepath.Join(c.opts.BinDir, "kube-apiserver"), c.flags.apiServerArgs(
		controlplane.APIServerArgs(p, fmt.Sprintf("http://127.0.0.1:%d", c.ports["etcd"]), c.ports["apiserver"])...)...); err != nil {
		return err
	}
	if err := c.waitHTTP(ctx, "kube-apiserver", c.apiServerURL+"/readyz", &p.AdminToken); err != nil {
		return err
	}
	if c.Client != nil {
		return nil // started again (StartAPIServer): the client stays
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 50, 100
	c.Client, err = kubernetes.NewForConfig(cfg)
	return err
}

// StopAPIServer kills kube-apiserver, as a crash or a lost control plane ends it for the node
// (its graceful stop would first drain its watches for seconds), and closes the pods' door to
// it: a pod's connection is refused from then on. etcd and every other component keep
// running, and keep trying to reach it. StartAPIServer brings it back.
func (c *Cluster) StopAPIServer() error {
	p := c.proc("kube-apiserver")
	if p == nil || p.Exited() {
		return errors.New("kube-apiserver is not running")
	}
	p.Kill()
	return c.door.close()
}

// StartAPIServer starts kube-apiserver again with the same flags, port and etcd, waits until
// it is ready (/readyz), and opens the pods' door to it again.
func (c *Cluster) StartAPIServer(ctx context.Context) error {
	if p := c.proc("kube-apiserver"); p != nil && !p.Exited() {
		return errors.New("kube-apiserver is running")
	}
	if err := c.startAPIServer(ctx); err != nil {
		return err
	}
	return c.openDoor()
}

// waitHTTP polls url until it answers 200, failing early if the component exited.
func (c *Cluster) waitHTTP(ctx context.Context, name, url string, token *string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	hc := insecureClient()
	if token != nil {
		// The admin token goes only to the API server, verified by the cluster's CA.
		var err error
		if hc, err = c.caClient(); err != nil {
			return err
		}
	}
	defer hc.CloseIdleConnections()
	return poll(ctx, 200*time.Millisecond, name+" answering "+url, func() (bool, error) {
		if err := c.exitedErr(name); err != nil {
			return false, err
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if token != nil {
			req.Header.Set("Authorization", "Bearer "+*token)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return false, err
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
		}
		return true, nil
	})
}

// caClient is an HTTP client that trusts only the cluster's CA (the API server's
// certificate).
func (c *Cluster) caClient() (*http.Client, error) {
	pem, err := os.ReadFile(c.pki.CACert)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificate", c.pki.CACert)
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}, nil
}

// exitedErr turns an exited component into an error that stops a poll at once.
func (c *Cluster) exitedErr(name string) error {
	if p := c.proc(name); p != nil {
		if p.Exited() {
			return fmt.Errorf("%w: %s exited (%v); last lines of %s:\n%s", errExited, name, p.Err(), p.log, Tail(p.log, 30))
		}
	}
	return nil
}

var errExited = errors.New("component exited")

// poll is wait.Poll, except that an error of cond wrapping errExited ends it at once, with that
// error: a component that exits at start fails the wait for it then, not at its deadline.
func poll(ctx context.Context, interval time.Duration, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var exited error
	err := wait.Poll(ctx, interval, what, func() (bool, error) {
		ok, err := cond()
		if errors.Is(err, errExited) {
			exited = err
			cancel()
		}
		return ok, err
	})
	if exited != nil {
		return fmt.Errorf("%s: %w", what, exited)
	}
	return err
}

// Stop tears the cluster down: components in order, then Cleanup. It is safe to call on a
// partly started cluster, and more than once or concurrently: the teardown runs once.
func (c *Cluster) Stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.stop() })
	return c.stopErr
}

func (c *Cluster) stop() error {
	c.mu.Lock()
	c.stopped = true
	c.mu.Unlock()
	errs := stopTracked(c.state.get().PIDs)
	for _, name := range clientComponents {
		if p := c.proc(name); p != nil {
			errs = append(errs, p.Stop(10*time.Second))
		}
	}
	if p := c.proc("containerd"); p != nil {
		if !p.Exited() {
			errs = append(errs, removeTasks(c.ContainerdAddress))
		}
	}
	errs = append(errs, c.door.close())
	for _, name := range serverComponents {
		if p := c.proc(name); p != nil {
			errs = append(errs, p.Stop(10*time.Second))
		}
	}
	if c.kubeletClient != nil {
		c.kubeletClient.CloseIdleConnections()
	}
	errs = append(errs, Cleanup(c.opts.Dir))
	return errors.Join(errs...)
}
