// Package mrproc builds the multireg binary and runs it as a user would: a child process with
// flags, signals and logs.
package mrproc

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// Run runs the multireg binary with args to completion and returns its combined output and
// exit code.
func Run(t testing.TB, args ...string) (string, int) {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return string(out), exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return string(out), 0
}

// Binary returns the path of a multireg binary: $MULTIREG_BIN if set, else one built once from
// the product module (the parent of this module) into a temporary directory.
func Binary() (string, error) {
	buildOnce.Do(func() {
		if p := os.Getenv("MULTIREG_BIN"); p != "" {
			buildPath, buildErr = filepath.Abs(p)
			return
		}
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		dir, err := os.MkdirTemp("", "mrbin")
		if err != nil {
			buildErr = err
			return
		}
		buildPath = filepath.Join(dir, "multireg")
		cmd := exec.Command("go", "build", "-race", "-o", buildPath, "./cmd/multireg")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("build multireg: %v\n%s", err, out)
		}
	})
	return buildPath, buildErr
}

// Process is a running multireg.
type Process struct {
	cmd  *exec.Cmd
	logs *lines
	done chan struct{}
	err  error // set before done is closed
}

// Start runs `multireg run --config cfg --log-format json -v 1 --http-endpoint 127.0.0.1:0`
// with extra args (a later --http-endpoint wins). The process
// is killed when the test ends, if it still runs.
func Start(t testing.TB, cfg string, args ...string) *Process {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	// Port 0: tests run several multireg at once; HTTPAddr reads the port from the log.
	all := append([]string{"run", "--config", cfg, "--log-format", "json", "-v", "1", "--http-endpoint", "127.0.0.1:0"}, args...)
	p := &Process{cmd: exec.Command(bin, all...), logs: &lines{}, done: make(chan struct{})}
	p.cmd.Stdout = p.logs
	p.cmd.Stderr = p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("multireg %s logs:\n%s", strings.Join(all, " "), p.logs.String())
		}
	})
	return p
}

// Signal sends sig to the process.
func (p *Process) Signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
}

// Wait waits up to timeout for the process to exit and returns its exit code.
func (p *Process) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("multireg did not exit within %v", timeout)
	}
	var exit *exec.ExitError
	if errors.As(p.err, &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return -int(ws.Signal())
		}
		return exit.ExitCode()
	}
	if p.err != nil {
		t.Fatalf("wait: %v", p.err)
	}
	return 0
}

// HTTPAddr returns the address the process serves HTTP on, once it has logged it, or "".
func (p *Process) HTTPAddr() string {
	for _, r := range p.Records() {
		if r["msg"] == "serving HTTP" {
			a, _ := r["address"].(string)
			return a
		}
	}
	return ""
}

// PID returns the process's id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Logs returns everything the process wrote so far.
func (p *Process) Logs() string { return p.logs.String() }

// Records returns the JSON log records written so far.
func (p *Process) Records() []map[string]any {
	var recs []map[string]any
	sc := bufio.NewScanner(strings.NewReader(p.logs.String()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r map[string]any
		if json.Unmarshal(sc.Bytes(), &r) == nil {
			recs = append(recs, r)
		}
	}
	return recs
}

// Phase returns the last phase the process logged for a driver, or "".
func (p *Process) Phase(driver string) string {
	phase := ""
	for _, r := range p.Records() {
		if r["msg"] == "phase changed" && r["driver"] == driver {
			phase, _ = r["phase"].(string)
		}
	}
	return phase
}

// Count returns how many records have msg and, if driver is not empty, that driver.
func (p *Process) Count(msg, driver string) int {
	n := 0
	for _, r := range p.Records() {
		if r["msg"] == msg && (driver == "" || r["driver"] == driver) {
			n++
		}
	}
	return n
}

// lines is a goroutine-safe log buffer.
type lines struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var _ io.Writer = (*lines)(nil)
