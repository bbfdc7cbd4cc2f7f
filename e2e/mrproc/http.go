package mrproc

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
)

// Status is GET /status.
type Status struct {
	Instance struct {
		Role      string `json:"role"`
		Detail    string `json:"detail"`
		Inherited int    `json:"inherited"`
	} `json:"instance"`
	Config struct {
		Path                 string `json:"path"`
		Generation           int    `json:"generation"`
		LastReloadSuccessful bool   `json:"lastReloadSuccessful"`
		LastReloadError      string `json:"lastReloadError"`
	} `json:"config"`
	Descriptors *struct {
		Limit      int    `json:"limit"`
		MaxSockets int    `json:"maxSockets"`
		Needed     int    `json:"needed"`
		Sockets    int    `json:"sockets"`
		Fits       bool   `json:"fits"`
		Problem    string `json:"problem"`
	} `json:"descriptors"`
	// Condition: the node condition, absent without --node-condition (NodeCondition).
	Condition *NodeConditionStatus `json:"nodeCondition"`
	Drivers   []DriverStatus       `json:"drivers"`
}

// NodeConditionStatus is what GET /status says of the node condition.
type NodeConditionStatus struct {
	Agent struct {
		Running  bool   `json:"running"`
		Starts   int    `json:"starts"`
		LastExit string `json:"lastExit"`
	} `json:"agent"`
	Status    string `json:"status"`
	Synced    bool   `json:"synced"`
	LastError string `json:"lastError"`
}

// NodeCondition returns what the status says of the node condition, and whether it says
// anything.
func (s Status) NodeCondition() (NodeConditionStatus, bool) {
	if s.Condition == nil {
		return NodeConditionStatus{}, false
	}
	return *s.Condition, true
}

// DriverStatus is one driver of GET /status.
type DriverStatus struct {
	Name       string `json:"name"`
	Type       string `json:"type"`
	Phase      string `json:"phase"`
	Socket     string `json:"socket"`
	Endpoint   string `json:"endpoint"`
	EndpointUp bool   `json:"endpointUp"`
	Absent     bool   `json:"absent"`
	Required   bool   `json:"required"`
	Attempts   int    `json:"attempts"`
	Failures   int    `json:"failures"`
	LastError  string `json:"lastError"`
}

// Driver returns the named driver's status, and whether there is one.
func (s Status) Driver(name string) (DriverStatus, bool) {
	for _, d := range s.Drivers {
		if d.Name == name {
			return d, true
		}
	}
	return DriverStatus{}, false
}

// httpClient opens a connection per request, so that no idle connection of ours lingers in
// multireg's goroutine and fd counts.
var httpClient = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

// URL waits until the process serves HTTP and returns its base URL.
func (p *Process) URL(t testing.TB) string {
	t.Helper()
	wait.Every(t, 100*time.Millisecond, 30*time.Second, "multireg to serve HTTP", func() bool { return p.HTTPAddr() != "" || p.Exited() })
	a := p.HTTPAddr()
	if a == "" {
		t.Fatalf("multireg exited before it served HTTP")
	}
	return "http://" + a
}

// Get returns the status code and body of GET path, or an error.
func (p *Process) Get(t testing.TB, path string) (int, string, error) {
	t.Helper()
	resp, err := httpClient.Get(p.URL(t) + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// Status returns GET /status.
func (p *Process) Status(t testing.TB) Status {
	t.Helper()
	code, body, err := p.Get(t, "/status")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /status: %d %v\n%s", code, err, body)
	}
	var doc Status
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("GET /status: %v\n%s", err, body)
	}
	return doc
}

// Healthy reports whether GET /healthz answers 200.
func (p *Process) Healthy(t testing.TB) bool {
	t.Helper()
	code, _, err := p.Get(t, "/healthz")
	return err == nil && code == http.StatusOK
}

// Metrics returns GET /metrics.
func (p *Process) Metrics(t testing.TB) string {
	t.Helper()
	code, body, err := p.Get(t, "/metrics")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /metrics: %d %v", code, err)
	}
	return body
}

// Metric returns the value of one series of a Prometheus text exposition, such as
// `multireg_registration_attempts_total{driver="x",result="timeout"}`, or -1 if absent.
func Metric(text, series string) float64 {
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
