package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// With -profile, the benchmark measures a copy of multireg with profiling added at build time
// (go build -overlay: one extra file in package main; the source tree is not touched):
//
//   - a CPU profile and an execution trace from the start of the process until every driver
//     is registered (SIGUSR1 stops them);
//   - net/http/pprof on a loopback port of its own, from which the benchmark saves a heap
//     profile and the goroutines after the idle window, and an execution trace across the
//     reload and across the recovery.
//
// Its figures are then those of that copy, not of the shipped build.
const pprofOverlay = `package main

import (
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"runtime/pprof"
	"runtime/trace"
	"syscall"
)

func init() {
	cpu, err1 := os.Create(os.Getenv("BENCH_CPUPROFILE"))
	tr, err2 := os.Create(os.Getenv("BENCH_TRACE"))
	if err1 == nil && err2 == nil && pprof.StartCPUProfile(cpu) == nil && trace.Start(tr) == nil {
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGUSR1)
		go func() {
			<-stop
			signal.Stop(stop)
			pprof.StopCPUProfile()
			trace.Stop()
			cpu.Close()
			tr.Close()
			fmt.Fprintln(os.Stderr, "{\"msg\":\"bench start-up profile written\"}")
		}()
	}
	if addr := os.Getenv("BENCH_PPROF"); addr != "" {
		if l, err := net.Listen("tcp", addr); err == nil {
			fmt.Fprintf(os.Stderr, "{\"msg\":\"bench pprof\",\"address\":%q}\n", l.Addr().String())
			go http.Serve(l, http.DefaultServeMux)
		}
	}
}
`

// buildProfiled builds multireg from root with the profiling overlay into out.
func buildProfiled(root, tmp, out string, env []string) error {
	src := filepath.Join(tmp, "zz_bench_pprof.go")
	if err := os.WriteFile(src, []byte(pprofOverlay), 0o644); err != nil {
		return err
	}
	overlay, err := json.Marshal(map[string]map[string]string{
		"Replace": {filepath.Join(root, "cmd", "multireg", "zz_bench_pprof.go"): src},
	})
	if err != nil {
		return err
	}
	ov := filepath.Join(tmp, "overlay.json")
	if err := os.WriteFile(ov, overlay, 0o644); err != nil {
		return err
	}
	return buildGo(root, out, env, "-overlay", ov, "-trimpath", "-tags", "grpcnotrace", "-ldflags", "-X main.version=bench-pprof", "./cmd/multireg")
}

// profiler saves profiles of one N's run into dir; a nil *profiler does nothing.
type profiler struct {
	dir string
	n   int
	mr  *multireg
	wg  sync.WaitGroup

	mu   sync.Mutex
	errs []error
}

func (p *profiler) path(name string) string {
	return filepath.Join(p.dir, fmt.Sprintf("N%d-%s", p.n, name))
}

// env returns multireg's extra environment.
func (p *profiler) env() []string {
	if p == nil {
		return nil
	}
	return []string{"BENCH_CPUPROFILE=" + p.path("startup.cpu.pprof"), "BENCH_TRACE=" + p.path("startup.trace"), "BENCH_PPROF=127.0.0.1:0"}
}

// stopCPU ends the start-up CPU profile.
func (p *profiler) stopCPU() {
	if p == nil {
		return
	}
	_ = p.mr.Signal(sigUSR1)
}

func (p *profiler) addr() string {
	if r, ok := p.mr.logs.find("bench pprof", "", time.Time{}); ok {
		a, _ := r.Fields["address"].(string)
		return a
	}
	return ""
}

// save fetches a pprof endpoint into a file, now.
func (p *profiler) save(endpoint, name string) {
	if p == nil {
		return
	}
	if err := p.fetch(endpoint, name); err != nil {
		p.fail(err)
	}
}

// trace starts an execution trace of d and returns once it runs; the rest is saved in the
// background, and wait collects it.
func (p *profiler) trace(d time.Duration, name string) {
	if p == nil {
		return
	}
	resp, err := p.get(fmt.Sprintf("/debug/pprof/trace?seconds=%.0f", d.Seconds()))
	if err != nil {
		p.fail(fmt.Errorf("trace %s: %w", name, err))
		return
	}
	p.wg.Go(func() {
		if err := p.copy(resp, name); err != nil {
			p.fail(err)
		}
	})
}

// cpu starts a CPU profile of d in the background; wait collects it.
func (p *profiler) cpu(d time.Duration, name string) {
	if p == nil {
		return
	}
	p.wg.Go(func() {
		if err := p.fetch(fmt.Sprintf("/debug/pprof/profile?seconds=%.0f", d.Seconds()), name); err != nil {
			p.fail(err)
		}
	})
}

func (p *profiler) wait() []error {
	if p == nil {
		return nil
	}
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.errs
}

func (p *profiler) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.errs = append(p.errs, err)
}

func (p *profiler) fetch(endpoint, name string) error {
	resp, err := p.get(endpoint)
	if err != nil {
		return fmt.Errorf("profile %s: %w", name, err)
	}
	return p.copy(resp, name)
}

// get requests a pprof endpoint; it returns once the response has begun.
func (p *profiler) get(endpoint string) (*http.Response, error) {
	addr := p.addr()
	if addr == "" {
		return nil, fmt.Errorf("multireg logged no pprof address")
	}
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + addr + endpoint)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %s", endpoint, resp.Status)
	}
	return resp, nil
}

// copy saves a response's body into the file name and closes it.
func (p *profiler) copy(resp *http.Response, name string) error {
	defer resp.Body.Close()
	f, err := os.Create(p.path(name))
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("profile %s: %w", name, err)
	}
	return f.Close()
}

const sigUSR1 = syscall.SIGUSR1
