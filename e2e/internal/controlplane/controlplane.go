// Package controlplane runs what the end-to-end tests need of a Kubernetes control plane:
// etcd (Debian's etcd-server) and kube-apiserver (built from source, e2e/node/build-kube.sh),
// on 127.0.0.1, with the credentials of PKI. e2e/node's single-node cluster starts them with
// these credentials and arguments; the node-condition suites start them alone (Start), with
// no kubelet, no root and no containerd, and stop and start the API server again to see what
// a node agent does while it is gone.
package controlplane

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
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
)

// APIServerArgs are kube-apiserver's arguments for a control plane on 127.0.0.1 with p's
// credentials, etcd at etcdURL and the API on port; a release's own go after them.
func APIServerArgs(p *PKI, etcdURL string, port int) []string {
	return []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--tls-cert-file=" + p.ServerCert, "--tls-private-key-file=" + p.ServerKey,
		"--client-ca-file=" + p.CACert, "--token-auth-file=" + p.TokenFile,
		"--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p.SAPub, "--service-account-signing-key-file=" + p.SAKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--kubelet-client-certificate=" + p.KubeletClientCert, "--kubelet-client-key=" + p.KubeletClientKey,
		"--kubelet-preferred-address-types=Hostname,InternalIP",
		"--enable-priority-and-fairness=false",
		// Without priority and fairness, its size-based cost estimate serves nothing; its
		// per-resource estimators list their keys a minute after the start, and on SIGTERM
		// each such list waits 3 s for a watch cache that no longer moves: a run longer than
		// a minute stopped the API server in 5 s to over 10 s (killed).
		"--feature-gates=SizeBasedListCostEstimate=false",
		"--profiling=false",
	}
}

// EtcdArgs are etcd's arguments: a single member with its data in dir, serving clients on
// clientPort and peers on peerPort.
func EtcdArgs(dir string, clientPort, peerPort int) []string {
	client := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peer := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	return []string{
		"--name=e2e", "--data-dir=" + dir,
		"--listen-client-urls=" + client, "--advertise-client-urls=" + client,
		"--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
		"--initial-cluster=e2e=" + peer, "--unsafe-no-fsync",
	}
}

// Options configure Start.
type Options struct {
	// Dir holds the control plane's files: etcd's data, the credentials, the kubeconfig.
	Dir string
	// APIServer is kube-apiserver's binary; Etcd etcd's ("" finds etcd in PATH).
	APIServer, Etcd string
	// Node is the node whose kubelet token PKI makes (the tests create the Node object).
	Node string
	// Log receives the components' output.
	Log io.Writer
}

// ControlPlane is a running etcd and kube-apiserver.
type ControlPlane struct {
	opts Options
	PKI  *PKI
	// URL is the API server's; Kubeconfig an admin kubeconfig for it.
	URL, Kubeconfig string
	args            []string

	mu        sync.Mutex
	etcd, api *child.Process
}

// Start starts etcd and kube-apiserver and returns once the API server is ready.
func Start(ctx context.Context, o Options) (cp *ControlPlane, err error) {
	if o.Log == nil {
		o.Log = io.Discard
	}
	if o.Etcd == "" {
		if o.Etcd, err = exec.LookPath("etcd"); err != nil {
			return nil, fmt.Errorf("etcd: %w (Debian's package etcd-server has it)", err)
		}
	}
	if _, err := os.Stat(o.APIServer); err != nil {
		return nil, fmt.Errorf("kube-apiserver: %w (e2e/node/build-kube.sh builds it)", err)
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	cp = &ControlPlane{opts: o, URL: fmt.Sprintf("https://127.0.0.1:%d", ports[2]), Kubeconfig: filepath.Join(o.Dir, "admin.kubeconfig")}
	defer func() {
		if err != nil {
			cp.Stop()
		}
	}()
	if cp.PKI, err = MakePKI(ctx, filepath.Join(o.Dir, "pki"), o.Node); err != nil {
		return nil, err
	}
	if err := WriteKubeconfig(cp.Kubeconfig, cp.URL, cp.PKI.CACert, cp.PKI.AdminToken); err != nil {
		return nil, err
	}
	cp.etcd, err = child.Start("etcd", cmdTo(o.Log, "etcd", o.Etcd, EtcdArgs(filepath.Join(o.Dir, "etcd"), ports[0], ports[1])...))
	if err != nil {
		return nil, err
	}
	if err := waitReady(ctx, cp.etcd, fmt.Sprintf("http://127.0.0.1:%d/health", ports[0]), nil, ""); err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	// The API server is 1.37's (build-kube.sh), which refuses a loopback advertised address with
	// the endpoint reconciler; no test uses the kubernetes Service's endpoints.
	cp.args = append(APIServerArgs(cp.PKI, fmt.Sprintf("http://127.0.0.1:%d", ports[0]), ports[2]), "--endpoint-reconciler-type=none")
	if err := cp.StartAPIServer(ctx); err != nil {
		return nil, err
	}
	return cp, nil
}

// StartAPIServer starts kube-apiserver (again, after StopAPIServer) and returns once it is
// ready.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.api != nil && !cp.api.Exited() {
		return errors.New("kube-apiserver runs already")
	}
	api, err := child.Start("kube-apiserver", cmdTo(cp.opts.Log, "kube-apiserver", cp.opts.APIServer, cp.args...))
	if err != nil {
		return err
	}
	cp.api = api
	client, err := caClient(cp.PKI.CACert)
	if err != nil {
		return err
	}
	if err := waitReady(ctx, api, cp.URL+"/readyz", client, cp.PKI.AdminToken); err != nil {
		return fmt.Errorf("kube-apiserver: %w", err)
	}
	return nil
}

// StopAPIServer kills kube-apiserver, as a crash or a lost control plane ends it for the
// nodes (its graceful stop waits for its watches to drain, over 15 s); etcd keeps the
// cluster's state.
func (cp *ControlPlane) StopAPIServer() {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.api != nil {
		cp.api.Kill()
		cp.api = nil
	}
}

// Stop stops kube-apiserver and etcd.
func (cp *ControlPlane) Stop() error {
	cp.StopAPIServer()
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.etcd == nil {
		return nil
	}
	err := cp.etcd.Stop(10 * time.Second)
	cp.etcd = nil
	return err
}

// cmdTo is the command name args, its output to log with each line prefixed.
func cmdTo(log io.Writer, prefix, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	w := child.Lines(func(line []byte) { fmt.Fprintf(log, "%s: %s\n", prefix, line) })
	cmd.Stdout, cmd.Stderr = w, w
	return cmd
}

// waitReady polls url until it answers 200, failing at once if p exits.
func waitReady(ctx context.Context, p *child.Process, url string, client *http.Client, token string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if client == nil {
		client = &http.Client{Timeout: 5 * time.Second}
	}
	defer client.CloseIdleConnections()
	var last error
	for {
		if p.Exited() {
			return fmt.Errorf("exited: %v", p.Err())
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s: %s", url, resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w", last)
		case <-p.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// caClient is an HTTPS client that trusts only the CA in caFile.
func caClient(caFile string) (*http.Client, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificate", caFile)
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}, nil
}

// freePorts returns n TCP ports free on 127.0.0.1 now.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
