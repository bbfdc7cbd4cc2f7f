package node_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
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
	port, err := cluster.FreePort()
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
	// Its own process group, as the cluster's components: a Ctrl-C reaches the test, which
	// stops it in order.
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = m.cmd.Wait(); close(m.done) }()
	t.Cleanup(func() { m.stop(t) })
	// Recorded with the cluster's processes: cmd/cleanup stops it if this binary dies.
	if err := cl.Track("multireg-host", m.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
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
			t.Errorf("multireg exited with %d after SIGTERM; log:\n%s", code, cluster.Tail(m.log, 30))
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
func (m *hostMultireg) registrations(ctx context.Context, names ...string) (map[string]int, error) {
	text, err := m.metrics(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, n := range names {
		v, _ := metric(text, "multireg_registration_attempts_total", map[string]string{"driver": n, "result": "registered"})
		out[n] = int(v)
	}
	return out, nil
}

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

// fileID identifies a file: inode and change time (an inode number alone is often reused at
// once for a socket created anew).
type fileID struct {
	ino   uint64
	ctime syscall.Timespec
}

// ident returns path's fileID, the zero value if it does not exist.
func ident(path string) fileID {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return fileID{}
	}
	return fileID{st.Ino, st.Ctim}
}

// tempDir is a new directory below the cluster's, which goes with it even if this binary
// dies (unlike t.TempDir's).
func tempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp(cl.Dir(), "test.")
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// scenario runs one scenario as a subtest and records its duration for the phase summary.
func scenario(t *testing.T, name string, f func(t *testing.T)) bool {
	start := time.Now()
	ok := t.Run(name, f)
	scenarioPhases = append(scenarioPhases, cluster.Phase{Name: "  " + name, Duration: time.Since(start)})
	return ok
}

// sockets maps each driver to the registration socket multireg reported for it in /status.
var sockets = map[string]string{}

func socketOf(t *testing.T, name string) string {
	t.Helper()
	p, ok := sockets[name]
	if !ok {
		t.Fatalf("no registration socket known for %s: it was never seen Registered", name)
	}
	return p
}

// stays checks, every 200 ms for d, that nothing moved: cond returns what moved, or "" if
// nothing did, or an error when it could not look (a request failed under load: looked at
// again next time). "Nothing else moves" is judged over a few reconcile passes, not at the
// instant the awaited change appeared; a check that never managed to look fails.
func stays(t *testing.T, d time.Duration, what string, cond func(ctx context.Context) (moved string, err error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	looked := 0
	var lastErr error
	for {
		moved, err := cond(ctx)
		switch {
		case err != nil:
			lastErr = err
		case moved != "":
			t.Errorf("%s: no longer so: %s", what, moved)
			return
		default:
			looked++
		}
		select {
		case <-ctx.Done():
			if looked == 0 {
				t.Errorf("%s: could not look once in %s: %v", what, d, lastErr)
			}
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// metric returns the value of the series name{labels…} in a Prometheus text exposition; ok
// is false if there is none.
func metric(text, name string, labels map[string]string) (value float64, ok bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		match := true
		for k, v := range labels {
			match = match && strings.Contains(line, fmt.Sprintf("%s=%q", k, v))
		}
		if !match {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, false
		}
		return v, true
	}
	return 0, false
}

func (m *hostMultireg) metrics(ctx context.Context) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.addr+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}
