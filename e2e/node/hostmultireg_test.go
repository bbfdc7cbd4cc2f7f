package node_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
	"multireg.dev/multireg/e2e/node/cluster"
)

// hostMultireg is multireg run on the host (as a systemd unit would), from the binary users get.
type hostMultireg struct {
	*child.Process
	addr string
	log  string
}

func startHostMultireg(t *testing.T, config string, extra ...string) *hostMultireg {
	t.Helper()
	port, err := cluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	m := &hostMultireg{addr: fmt.Sprintf("127.0.0.1:%d", port), log: config + ".log"}
	args := append([]string{"run", "--config", config, "--http-endpoint", m.addr}, extra...)
	// Its own process group, as the cluster's components: a Ctrl-C reaches the test, which
	// stops it in order.
	if m.Process, err = cluster.StartProc("multireg", m.log, *multiregBin, args...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.stop(t) })
	// Recorded with the cluster's processes: cmd/cleanup stops it if this binary dies.
	if err := cl.Track("multireg-host", m.PID()); err != nil {
		t.Fatal(err)
	}
	return m
}

// stop sends SIGTERM and waits for the exit (multireg stops within 5 s).
func (m *hostMultireg) stop(t *testing.T) {
	if m.Exited() {
		return
	}
	if err := m.Stop(15 * time.Second); err != nil {
		t.Error(err)
	} else if err := m.Err(); err != nil {
		t.Errorf("multireg exited with %v after SIGTERM; log:\n%s", err, cluster.Tail(m.log, 30))
	}
}

// driverStatus is a driver of multireg's /status.
type driverStatus struct {
	Name       string `json:"name"`
	Phase      string `json:"phase"`
	Socket     string `json:"socket"`
	Endpoint   string `json:"endpoint"`
	EndpointUp bool   `json:"endpointUp"`
	Attempts   int    `json:"attempts"`
	Failures   int    `json:"failures"`
	LastError  string `json:"lastError"`
}

func (m *hostMultireg) status(ctx context.Context) (map[string]driverStatus, error) {
	return statusAt(ctx, "http://"+m.addr+"/status")
}

// reloadState returns whether multireg applied the last drivers file it read, and why not.
func (m *hostMultireg) reloadState(ctx context.Context) (ok bool, lastErr string, err error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+m.addr+"/status", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false, "", err
	}
	defer resp.Body.Close()
	var doc struct {
		Config struct {
			LastReloadSuccessful bool   `json:"lastReloadSuccessful"`
			LastReloadError      string `json:"lastReloadError"`
		} `json:"config"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return false, "", err
	}
	return doc.Config.LastReloadSuccessful, doc.Config.LastReloadError, nil
}

// instanceStatus is the "instance" of multireg's /status: its role (starting, serving,
// standby, idle) and, serving, how many sockets its predecessor handed over.
type instanceStatus struct {
	Role      string `json:"role"`
	Detail    string `json:"detail"`
	Inherited int    `json:"inherited"`
}

func statusAt(ctx context.Context, url string) (map[string]driverStatus, error) {
	_, drivers, err := statusDocAt(ctx, url)
	return drivers, err
}

// statusDocAt returns the instance and the drivers of the /status at url. (A release before
// hand-overs has no instance: its role is "".)
func statusDocAt(ctx context.Context, url string) (instanceStatus, map[string]driverStatus, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return instanceStatus{}, nil, err
	}
	defer resp.Body.Close()
	var doc struct {
		Instance instanceStatus `json:"instance"`
		Drivers  []driverStatus `json:"drivers"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return instanceStatus{}, nil, fmt.Errorf("%s: %w", url, err)
	}
	out := map[string]driverStatus{}
	for _, d := range doc.Drivers {
		out[d.Name] = d
	}
	return doc.Instance, out, nil
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
