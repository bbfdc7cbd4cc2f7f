package registration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
)

// prober asks GET /healthz/<driver> at url every period, as kubelet's livenessProbe does (a
// new connection each time), and counts the answers that are not 200.
type prober struct {
	url             string
	ok, failed      atomic.Int64
	mu              sync.Mutex
	firstFailures   []string
	stop            chan struct{}
	done            sync.WaitGroup
	timeout, period time.Duration
}

func startProber(t *testing.T, url string, period time.Duration) *prober {
	p := &prober{url: url, stop: make(chan struct{}), timeout: time.Second, period: period}
	client := &http.Client{Timeout: p.timeout, Transport: &http.Transport{DisableKeepAlives: true}}
	p.done.Go(func() {
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
			resp, err := client.Get(url)
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = fmt.Errorf("%s", resp.Status)
				}
			}
			if err == nil {
				p.ok.Add(1)
				continue
			}
			p.failed.Add(1)
			p.mu.Lock()
			if len(p.firstFailures) < 20 {
				p.firstFailures = append(p.firstFailures, time.Now().Format("15:04:05.000")+" "+err.Error())
			}
			p.mu.Unlock()
		}
	})
	t.Cleanup(p.end)
	return p
}

func (p *prober) end() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	p.done.Wait()
}

// freeTCPPort is a port free on 127.0.0.1 now.
func freeTCPPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// 8. A driver's liveness checks through 20 rolling updates of multireg: each new instance
// takes the directory and the health endpoint's listener over from the old one, which then
// exits; a check every 50 ms (twenty times a driver pod's periodSeconds: 1, whose
// failureThreshold: 1 would restart the driver at the first failure) never fails. Both
// instances listen on one --http-endpoint too, as two pods on the host's network do: once the
// new one has taken over, every request there reaches it (it has the old one's socket, and the
// old one serves it no more), so that kubelet's probes of the new pod are answered by the
// instance that serves the drivers, never by the idle one.
func TestHealthChecksThroughRollouts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "probed.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoints([]driver{d})
	addr := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	httpAddr := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	p := mrproc.Start(t, e.WriteConfig([]driver{d}), "--health-endpoint", addr, "--http-endpoint", httpAddr)
	wait.For(t, registerTimeout, "registered", func() bool { return registeredEverywhere(t, e, p, []driver{d}) })
	pr := startProber(t, "http://"+addr+"/healthz/"+d.Name, 50*time.Millisecond)
	ready := startProber(t, "http://"+httpAddr+"/readyz", 50*time.Millisecond)
	wait.For(t, registerTimeout, "a first check answered", func() bool { return pr.ok.Load() > 0 && ready.ok.Load() > 0 })
	counts := e.Registrations([]driver{d})
	var events []string
	note := func(what string) { events = append(events, time.Now().Format("15:04:05.000")+" "+what) }
	defer func() {
		if t.Failed() {
			t.Logf("the rollouts:\n%s", strings.Join(events, "\n"))
		}
	}()
	for i := range 20 {
		note(fmt.Sprintf("rollout %d starts", i+1))
		next := mrproc.Start(t, e.Cfg, "--health-endpoint", addr, "--http-endpoint", httpAddr)
		wait.For(t, registerTimeout, fmt.Sprintf("rollout %d: the new instance to take over", i+1), func() bool {
			return next.Count(msgTookOver, "") == 1
		})
		wait.For(t, registerTimeout, fmt.Sprintf("rollout %d: the new instance to serve", i+1), func() bool {
			return next.Status(t).Instance.Role == "serving"
		})
		// A new connection each time: the kernel would spread them over both instances'
		// sockets were there two, and the old one would say "idle".
		for j := range 20 {
			if st := next.Status(t); st.Instance.Role != "serving" {
				t.Fatalf("rollout %d: request %d to --http-endpoint after the take-over answered by the %s instance", i+1, j+1, st.Instance.Role)
			}
		}
		note("taken over; SIGTERM to the old")
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, exitTimeout); code != 0 {
			t.Fatalf("rollout %d: the old instance exited %d", i+1, code)
		}
		p = next
	}
	before := pr.ok.Load()
	wait.For(t, registerTimeout, "checks answered after the last rollout", func() bool { return pr.ok.Load() > before+5 })
	pr.end()
	ready.end()
	t.Logf("%d checks answered through 20 rollouts, %d failed: %v", pr.ok.Load(), pr.failed.Load(), pr.firstFailures)
	// Not an error: /readyz says 503 while the old instance hands over, and while the new one
	// starts (a few milliseconds each rollout). Every request is answered, though: none is
	// lost on a socket closed, or by a server stopped, in a hand-over.
	t.Logf("/readyz every 50 ms: %d ready, %d not: %v", ready.ok.Load(), ready.failed.Load(), ready.firstFailures)
	for _, f := range ready.firstFailures {
		if !strings.HasSuffix(f, " 503 Service Unavailable") {
			t.Errorf("a /readyz request not answered through the rollouts: %s", f)
		}
	}
	if pr.failed.Load() != 0 {
		t.Errorf("%d checks failed through the rollouts: %v", pr.failed.Load(), pr.firstFailures)
	}
	if got := e.Registrations([]driver{d}); got[d.Name] != counts[d.Name] {
		t.Errorf("kubelet registered the driver %d times more", got[d.Name]-counts[d.Name])
	}
	if _, body, err := p.Get(t, "/status"); err != nil || !strings.Contains(body, `"liveness"`) || !strings.Contains(body, `"alive": true`) {
		t.Errorf("/status does not show the driver's last liveness check (%v):\n%s", err, body)
	}
	stop := p
	stop.Signal(t, syscall.SIGTERM)
	stop.Wait(t, exitTimeout)
}

// 8b. Without a hand-over (the standby path: the two instances speak no common protocol),
// both instances listen on the health endpoint's port; when the old one exits, the checks the
// kernel had queued on its socket are refused. Their number is logged: the bound docs state
// (how many checks a driver's probe may lose, and the settings that make that safe).
func TestHealthChecksThroughAStandby(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "standby.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoints([]driver{d})
	addr := fmt.Sprintf("127.0.0.1:%d", freeTCPPort(t))
	p := mrproc.Start(t, e.WriteConfig([]driver{d}), "--health-endpoint", addr)
	wait.For(t, registerTimeout, "registered", func() bool { return registeredEverywhere(t, e, p, []driver{d}) })
	pr := startProber(t, "http://"+addr+"/healthz/"+d.Name, 10*time.Millisecond)
	second := mrproc.StartWith(t, mrproc.Options{Env: []string{"MULTIREG_TEST_HANDOVER_PROTOCOL=3"}}, e.Cfg, "--health-endpoint", addr)
	wait.For(t, registerTimeout, "the new instance to stand by", func() bool { return second.Count(msgStandby, "") == 1 })
	before := pr.ok.Load()
	wait.For(t, registerTimeout, "checks answered while both listen", func() bool { return pr.ok.Load() > before+50 })
	exited := time.Now()
	p.Signal(t, syscall.SIGTERM)
	p.Wait(t, exitTimeout)
	wait.For(t, registerTimeout, "the standby to serve the directory", func() bool { return second.Count(msgServing, "") == 1 })
	after := pr.ok.Load()
	wait.For(t, registerTimeout, "checks answered after", func() bool { return pr.ok.Load() > after+20 })
	pr.end()
	t.Logf("a check every 10 ms: %d answered, %d failed around the old instance's exit (%s ago): %v",
		pr.ok.Load(), pr.failed.Load(), time.Since(exited).Round(time.Millisecond), pr.firstFailures)
	for _, f := range pr.firstFailures {
		if !strings.Contains(f, "connection reset") && !strings.Contains(f, "EOF") && !strings.Contains(f, "refused") {
			t.Errorf("a check failed otherwise than on the old instance's closed socket: %s", f)
		}
	}
	if pr.failed.Load() > 2 {
		t.Errorf("%d checks failed, want at most the two the old socket's queue may hold at its close", pr.failed.Load())
	}
	second.Signal(t, syscall.SIGTERM)
	second.Wait(t, exitTimeout)
}
