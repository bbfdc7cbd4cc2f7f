package faults

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/mrproc"
)

// statusDoc is GET /status.
type statusDoc struct {
	Config struct {
		Path                 string `json:"path"`
		Generation           int    `json:"generation"`
		LastReloadSuccessful bool   `json:"lastReloadSuccessful"`
		LastReloadError      string `json:"lastReloadError"`
	} `json:"config"`
	Drivers []driverStatus `json:"drivers"`
}

type driverStatus struct {
	Name       string `json:"name"`
	Type       string `json:"type"`
	Phase      string `json:"phase"`
	Socket     string `json:"socket"`
	Endpoint   string `json:"endpoint"`
	EndpointUp bool   `json:"endpointUp"`
	Attempts   int    `json:"attempts"`
	Failures   int    `json:"failures"`
	LastError  string `json:"lastError"`
}

func (s statusDoc) driver(name string) (driverStatus, bool) {
	for _, d := range s.Drivers {
		if d.Name == name {
			return d, true
		}
	}
	return driverStatus{}, false
}

// httpClient opens a connection per request, so that no idle connection of ours lingers in
// multireg's goroutine and fd counts.
var httpClient = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// addrs caches each process's HTTP address: Process.HTTPAddr copies and parses every log line
// so far. Once the logs are long (200 drivers at -v 1), polling it takes enough CPU on two
// cores to slow multireg and kubelet down to kubelet's 1 s GetInfo deadline.
var addrs sync.Map // *mrproc.Process → string

// baseURL waits until the process serves HTTP and returns its URL.
func baseURL(t testing.TB, p *mrproc.Process) string {
	t.Helper()
	if a, ok := addrs.Load(p); ok {
		return "http://" + a.(string)
	}
	poll(t, registerTimeout, "multireg to serve HTTP", func() bool { return p.HTTPAddr() != "" || p.Exited() })
	a := p.HTTPAddr()
	if a == "" {
		t.Fatalf("multireg exited before it served HTTP")
	}
	addrs.Store(p, a)
	return "http://" + a
}

// poll is kubelet.WaitFor at a slower pace, for conditions that cost the process a request.
func poll(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// get returns the status code and body of GET path, or an error.
func get(t testing.TB, p *mrproc.Process, path string) (int, string, error) {
	t.Helper()
	resp, err := httpClient.Get(baseURL(t, p) + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// status returns GET /status.
func status(t testing.TB, p *mrproc.Process) statusDoc {
	t.Helper()
	code, body, err := get(t, p, "/status")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /status: %d %v\n%s", code, err, body)
	}
	var doc statusDoc
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("GET /status: %v\n%s", err, body)
	}
	return doc
}

// healthy reports whether GET /healthz answers 200.
func healthy(t testing.TB, p *mrproc.Process) bool {
	t.Helper()
	code, _, err := get(t, p, "/healthz")
	return err == nil && code == http.StatusOK
}

// phases returns every driver's phase from /status.
func phases(t testing.TB, p *mrproc.Process) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, d := range status(t, p).Drivers {
		m[d.Name] = d.Phase
	}
	return m
}

// waitPhases waits until /status shows every driver of ds in phase.
func waitPhases(t testing.TB, p *mrproc.Process, ds []driver, phase string) {
	t.Helper()
	var last map[string]string
	poll(t, registerTimeout, fmt.Sprintf("%d drivers %s in multireg's /status", len(ds), phase), func() bool {
		last = phases(t, p)
		for _, d := range ds {
			if last[d.name] != phase {
				return false
			}
		}
		return true
	})
}

// waitDriver waits until the driver's /status entry satisfies cond, and returns it.
func waitDriver(t testing.TB, p *mrproc.Process, name, what string, cond func(driverStatus) bool) driverStatus {
	t.Helper()
	var last driverStatus
	poll(t, registerTimeout, what, func() bool {
		d, ok := status(t, p).driver(name)
		last = d
		return ok && cond(d)
	})
	return last
}

// metrics returns GET /metrics.
func metrics(t testing.TB, p *mrproc.Process) string {
	t.Helper()
	code, body, err := get(t, p, "/metrics")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %v", code, err)
	}
	return body
}

// metric returns the value of one series, such as
// `multireg_registration_attempts_total{driver="x",result="timeout"}`, or -1 if absent.
func metric(text, series string) float64 {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// metricSum adds every series of a metric name whose labels contain each of the given
// `label="value"` pairs.
func metricSum(text, name string, labels ...string) float64 {
	sum := 0.0
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
next:
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(line, l) {
				continue next
			}
		}
		i := strings.LastIndexByte(line, ' ')
		if f, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			sum += f
		}
	}
	return sum
}

// pids returns the ids of the multireg processes that run with the drivers file cfg.
func pids(t testing.TB, cfg string) []int {
	t.Helper()
	bin, err := mrproc.Binary()
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) < 2 || args[0] != bin || args[1] != "run" {
			continue
		}
		for i, a := range args {
			if a == "--config" && i+1 < len(args) && args[i+1] == cfg {
				pid, _ := strconv.Atoi(filepath.Base(d))
				out = append(out, pid)
				break
			}
		}
	}
	return out
}

// pidOf returns the id of the one multireg process running with the drivers file cfg.
func pidOf(t testing.TB, cfg string) int {
	t.Helper()
	ps := pids(t, cfg)
	if len(ps) != 1 {
		t.Fatalf("%d multireg processes run with %s, want 1: %v", len(ps), cfg, ps)
	}
	return ps[0]
}

// resources is what a process holds: open fds and inotify watches, and its goroutines.
type resources struct {
	goroutines, fds, watches int
}

func (r resources) String() string {
	return fmt.Sprintf("%d goroutines, %d fds, %d inotify watches", r.goroutines, r.fds, r.watches)
}

// usage reads the resources of the multireg process p (pid): goroutines from /metrics
// (go_goroutines), fds from /proc/PID/fd, inotify watches from the "inotify wd:" lines of
// /proc/PID/fdinfo.
func usage(t testing.TB, p *mrproc.Process, pid int) resources {
	t.Helper()
	var r resources
	r.goroutines = int(metric(metrics(t, p), "go_goroutines"))
	fdDir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(fdDir)
	if err != nil {
		t.Fatal(err)
	}
	r.fds = len(fds)
	for _, fd := range fds {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		r.watches += bytes.Count(b, []byte("inotify wd:"))
	}
	return r
}

// waitCount waits until the process has logged msg (for driver, if not "") want times — a line
// reaches the test a moment after the process wrote it — and fails if it logged it more often.
func waitCount(t testing.TB, p *mrproc.Process, msg, driver string, want int) {
	t.Helper()
	poll(t, registerTimeout, fmt.Sprintf("%d %q log lines", want, msg), func() bool { return p.Count(msg, driver) >= want })
	if got := p.Count(msg, driver); got != want {
		t.Errorf("%d %q log lines, want %d", got, msg, want)
	}
}

// waitStable waits until cond has held for quietPeriod without a break, within timeout.
func waitStable(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var since time.Time // when cond last became true
	for {
		switch {
		case !cond():
			since = time.Time{}
		case since.IsZero():
			since = time.Now()
		case time.Since(since) >= quietPeriod:
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s (for %v)", timeout, what, quietPeriod)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
