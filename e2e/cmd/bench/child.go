package main

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
)

// startChild starts cmd as a child.Process named name, to be killed by the kernel if the
// benchmark dies first (Pdeathsig).
func startChild(name string, cmd *exec.Cmd) (*child.Process, error) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return child.Start(name, cmd)
}

// logRecord is one JSON log line of multireg.
type logRecord struct {
	Time   time.Time // multireg's own stamp: millisecond precision (log/slog)
	Read   time.Time // when the benchmark read the line
	Msg    string
	Driver string
	Fields map[string]any
}

// mrLogs keeps multireg's JSON log records, the garbage collector's lines (GODEBUG=gctrace=1)
// and the last raw lines for error reports.
type mrLogs struct {
	mu     sync.Mutex
	recs   []logRecord
	gcs    int
	lastGC string
	tail   []string
}

const tailLines = 40

func (l *mrLogs) add(line []byte) {
	now := time.Now()
	var m map[string]any
	rec := logRecord{Read: now}
	if json.Unmarshal(line, &m) == nil {
		rec.Fields = m
		rec.Msg, _ = m["msg"].(string)
		rec.Driver, _ = m["driver"].(string)
		if s, ok := m["time"].(string); ok {
			rec.Time, _ = time.Parse(time.RFC3339Nano, s)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if rec.Fields != nil {
		l.recs = append(l.recs, rec)
	} else if bytes.HasPrefix(line, []byte("gc ")) {
		l.gcs++
		l.lastGC = string(line)
	}
	l.tail = append(l.tail, string(line))
	if len(l.tail) > tailLines {
		l.tail = l.tail[len(l.tail)-tailLines:]
	}
}

// find returns the first record with msg (and driver, if not empty) read at or after t.
func (l *mrLogs) find(msg, driver string, t time.Time) (logRecord, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.recs {
		if r.Msg == msg && (driver == "" || r.Driver == driver) && !r.Read.Before(t) {
			return r, true
		}
	}
	return logRecord{}, false
}

// gc returns how many garbage collections multireg has reported, and the last report.
func (l *mrLogs) gc() (int, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.gcs, l.lastGC
}

// problems counts the WARN and ERROR records by level, message and error.
func (l *mrLogs) problems() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := map[string]int{}
	for _, r := range l.recs {
		if lv, _ := r.Fields["level"].(string); lv == "WARN" || lv == "ERROR" {
			key := lv + " " + r.Msg
			if e, ok := r.Fields["err"].(string); ok {
				// The cause only, without the paths and names that differ by driver.
				if i := strings.LastIndex(e, ": "); i >= 0 {
					e = e[i+2:]
				}
				key += " (…: " + e + ")"
			}
			m[key]++
		}
	}
	return m
}

func (l *mrLogs) Tail() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.tail, "\n")
}

// multireg is a running `multireg run`.
type multireg struct {
	*child.Process
	logs *mrLogs
}

func startMultireg(bin, cfg string, env []string, args ...string) (*multireg, error) {
	logs := &mrLogs{}
	sink := child.Lines(logs.add)
	cmd := exec.Command(bin, append([]string{"run", "--config", cfg, "--log-format", "json", "--http-endpoint", "127.0.0.1:0"}, args...)...)
	cmd.Stdout, cmd.Stderr = sink, sink
	cmd.Env = env
	c, err := startChild("multireg", cmd)
	if err != nil {
		return nil, err
	}
	return &multireg{Process: c, logs: logs}, nil
}

// httpAddr returns the address multireg logged it serves HTTP on, or "".
func (m *multireg) httpAddr() string {
	if r, ok := m.logs.find("serving HTTP", "", time.Time{}); ok {
		a, _ := r.Fields["address"].(string)
		return a
	}
	return ""
}

// exitError describes how multireg ended, with its last log lines.
func (m *multireg) exitError() error {
	return fmt.Errorf("multireg exited (%v); last log lines:\n%s", m.Err(), m.logs.Tail())
}

// endpoints is the process serving the plugin endpoints. It ends when its standard input
// does (-stdin-eof): with the benchmark, whatever way that ends.
type endpoints struct {
	*child.Process
	stdin  io.Closer
	ready  chan struct{}
	stderr *mrLogs // raw lines only
}

func startEndpoints(bin, list string) (*endpoints, error) {
	e := &endpoints{ready: make(chan struct{}), stderr: &mrLogs{}}
	var once sync.Once
	cmd := exec.Command(bin, "-list", list, "-stdin-eof")
	cmd.Stdout = child.Lines(func(line []byte) {
		if bytes.HasPrefix(line, []byte("ready ")) {
			once.Do(func() { close(e.ready) })
		}
	})
	cmd.Stderr = child.Lines(e.stderr.add)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	c, err := startChild("endpoints", cmd)
	if err != nil {
		return nil, err
	}
	e.Process, e.stdin = c, stdin
	return e, nil
}

// stop closes the standard input, then stops the process like child.Process.Stop; it also
// returns the error of an exit other than 0.
func (e *endpoints) stop(grace time.Duration) error {
	e.stdin.Close()
	return cmp.Or(e.Stop(grace), e.Err())
}

// waitReady waits until the endpoints all listen.
func (e *endpoints) waitReady(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-e.ready:
		return nil
	case <-e.Done():
		return fmt.Errorf("endpoints exited (%v):\n%s", e.Err(), e.stderr.Tail())
	case <-t.C:
		return errors.New("endpoints not ready within " + timeout.String())
	}
}

// buildGo runs `go build` in dir and returns the output path.
func buildGo(dir, out string, env []string, args ...string) error {
	cmd := exec.Command("go", append([]string{"build", "-o", out}, args...)...)
	cmd.Dir = dir
	cmd.Env = env
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s in %s: %v\n%s", strings.Join(args, " "), dir, err, b)
	}
	return nil
}

// scanLines is bufio.ScanLines for strings.
func scanLines(s string) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	return out
}
