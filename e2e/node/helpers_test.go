package node_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/node/cluster"
)

// hostMultireg is multireg run on the host (as a systemd unit would), from the binary users get.
type hostMultireg struct {
	cmd  *exec.Cmd
	done chan struct{}
	addr string
	log  string
}

func startHostMultireg(t *testing.T, config string, extra ...string) *hostMultireg {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	m := &hostMultireg{addr: fmt.Sprintf("127.0.0.1:%d", port), log: config + ".log", done: make(chan struct{})}
	f, err := os.Create(m.log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	args := append([]string{"run", "--config", config, "--http-endpoint", m.addr}, extra...)
	m.cmd = exec.Command(*multiregBin, args...)
	m.cmd.Stdout, m.cmd.Stderr = f, f
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = m.cmd.Wait(); close(m.done) }()
	t.Cleanup(func() { m.stop(t) })
	return m
}

// stop sends SIGTERM and waits for the exit (multireg stops within 5 s).
func (m *hostMultireg) stop(t *testing.T) {
	select {
	case <-m.done:
		return
	default:
	}
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.done:
		if code := m.cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("multireg exited with %d after SIGTERM; log:\n%s", code, readTail(m.log, 30))
		}
	case <-time.After(15 * time.Second):
		_ = m.cmd.Process.Kill()
		<-m.done
		t.Errorf("multireg still ran 15 s after SIGTERM: killed")
	}
}

func (m *hostMultireg) pid() int { return m.cmd.Process.Pid }

func (m *hostMultireg) running() bool {
	select {
	case <-m.done:
		return false
	default:
		return true
	}
}

// driverStatus is a driver of multireg's /status.
type driverStatus struct {
	Name       string `json:"name"`
	Phase      string `json:"phase"`
	Socket     string `json:"socket"`
	EndpointUp bool   `json:"endpointUp"`
	Attempts   int    `json:"attempts"`
	Failures   int    `json:"failures"`
	LastError  string `json:"lastError"`
}

func (m *hostMultireg) status(ctx context.Context) (map[string]driverStatus, error) {
	return statusAt(ctx, "http://"+m.addr+"/status")
}

func statusAt(ctx context.Context, url string) (map[string]driverStatus, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var doc struct {
		Drivers []driverStatus `json:"drivers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return nil, fmt.Errorf("%s: %w", url, err)
	}
	out := map[string]driverStatus{}
	for _, d := range doc.Drivers {
		out[d.Name] = d
	}
	return out, nil
}

// registrations returns multireg's count of registrations kubelet accepted, per driver
// (multireg_registration_attempts_total{result="registered"}): it grows when kubelet
// registers a driver again on the same socket, as after a kubelet restart.
func (m *hostMultireg) registrations(ctx context.Context) (map[string]int, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.addr+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]int{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "multireg_registration_attempts_total{") || !strings.Contains(line, `result="registered"`) {
			continue
		}
		m := registeredMetric.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("unexpected metric line %q", line)
		}
		n, err := strconv.Atoi(m[2])
		if err != nil {
			return nil, fmt.Errorf("metric line %q: %w", line, err)
		}
		out[m[1]] = n
	}
	return out, sc.Err()
}

var registeredMetric = regexp.MustCompile(`driver="([^"]+)".* (\d+)$`)

// writeFileAtomic replaces path with content by a rename, as editors and config management do.
func writeFileAtomic(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// waitUntil polls cond every 100 ms until it holds or d passes; the failure names what was
// awaited and cond's last explanation.
func waitUntil(t *testing.T, d time.Duration, what string, cond func(ctx context.Context) (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var last string
	for {
		ok, why := cond(ctx)
		if ok {
			return time.Since(start)
		}
		last = why
		select {
		case <-ctx.Done():
			t.Fatalf("%s: not within %s; last: %s", what, d, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// csiNodeDrivers returns CSINode's drivers of the node: name → node ID.
func csiNodeDrivers(ctx context.Context) (map[string]string, error) {
	n, err := cl.Client.StorageV1().CSINodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, d := range n.Spec.Drivers {
		out[d.Name] = d.NodeID
	}
	return out, nil
}

// capacity returns the node's capacity and allocatable of an extended resource.
func capacity(ctx context.Context, resource string) (capacity, allocatable int64, err error) {
	n, err := cl.Client.CoreV1().Nodes().Get(ctx, cluster.NodeName, metav1.GetOptions{})
	if err != nil {
		return 0, 0, err
	}
	c := n.Status.Capacity[corev1.ResourceName(resource)]
	a := n.Status.Allocatable[corev1.ResourceName(resource)]
	return c.Value(), a.Value(), nil
}

var pluginMetric = regexp.MustCompile(`^plugin_manager_total_plugins\{socket_path="([^"]+)",state="actual_state_of_world"\} (\d+)`)

// kubeletRegistered returns the registration sockets kubelet's plugin manager holds as
// registered (its actual state of the world: RegisterPlugin succeeded), read from kubelet's
// own metrics.
func kubeletRegistered(ctx context.Context) (map[string]bool, error) {
	text, err := cl.KubeletMetrics(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if m := pluginMetric.FindStringSubmatch(sc.Text()); m != nil {
			n, _ := strconv.Atoi(m[2])
			out[m[1]] = n > 0
		}
	}
	return out, sc.Err()
}

// inode returns the inode of path's file, 0 if it does not exist.
func inode(path string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return 0
	}
	return st.Ino
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func readTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// scenario runs one scenario as a subtest and records its duration for the phase summary.
func scenario(t *testing.T, name string, f func(t *testing.T)) bool {
	start := time.Now()
	ok := t.Run(name, f)
	scenarioPhases = append(scenarioPhases, cluster.Phase{Name: "  " + name, Duration: time.Since(start)})
	return ok
}

// regSocket is the registration socket multireg publishes for a driver by default.
func regSocket(name string) string {
	return filepath.Join(cl.PluginsRegistry, strings.NewReplacer("/", "_").Replace(name)+"-reg.sock")
}
