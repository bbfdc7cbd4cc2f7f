package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// child is a process the benchmark started and owns: it is stopped by stop (by PID), and
// killed by the kernel if the benchmark dies first (Pdeathsig).
type child struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser // nil unless asked for
	done  chan struct{}  // closed once Wait has returned
	err   error          // Wait's result, set before done is closed
	once  sync.Once
}

func startChild(name string, cmd *exec.Cmd, withStdin bool) (*child, error) {
	c := &child{name: name, cmd: cmd, done: make(chan struct{})}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if withStdin {
		w, err := cmd.StdinPipe()
		if err != nil {
			return nil, err
		}
		c.stdin = w
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, waits up to grace, then SIGKILL, and waits for the exit. It returns the
// exit error of a process that had to be killed or did not exit 0; it is idempotent.
func (c *child) stop(grace time.Duration) error {
	var err error
	c.once.Do(func() {
		if c.stdin != nil {
			c.stdin.Close()
		}
		if !c.exited() {
			_ = c.cmd.Process.Signal(syscall.SIGTERM)
		}
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-c.done:
			err = c.err
		case <-t.C:
			_ = c.cmd.Process.Kill()
			<-c.done
			err = fmt.Errorf("%s did not exit within %v of SIGTERM; killed", c.name, grace)
		}
	})
	return err
}

// lineSink is an io.Writer that calls fn with each complete line.
type lineSink struct {
	mu      sync.Mutex
	partial []byte
	fn      func(line []byte)
}

func (s *lineSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.partial = append(s.partial, p...)
	for {
		i := bytes.IndexByte(s.partial, '\n')
		if i < 0 {
			break
		}
		s.fn(s.partial[:i])
		s.partial = s.partial[i+1:]
	}
	return len(p), nil
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
	*child
	logs *mrLogs
}

func startMultireg(bin, cfg string, env []string) (*multireg, error) {
	logs := &mrLogs{}
	sink := &lineSink{fn: logs.add}
	cmd := exec.Command(bin, "run", "--config", cfg, "--log-format", "json", "--http-endpoint", "127.0.0.1:0")
	cmd.Stdout, cmd.Stderr = sink, sink
	cmd.Env = env
	c, err := startChild("multireg", cmd, false)
	if err != nil {
		return nil, err
	}
	return &multireg{child: c, logs: logs}, nil
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
	return fmt.Errorf("multireg exited (%v); last log lines:\n%s", m.err, m.logs.Tail())
}

// endpoints is the process serving the plugin endpoints.
type endpoints struct {
	*child
	ready  chan struct{}
	stderr *mrLogs // raw lines only
}

func startEndpoints(bin, list string) (*endpoints, error) {
	e := &endpoints{ready: make(chan struct{}), stderr: &mrLogs{}}
	var once sync.Once
	cmd := exec.Command(bin, "-list", list, "-stdin-eof")
	cmd.Stdout = &lineSink{fn: func(line []byte) {
		if bytes.HasPrefix(line, []byte("ready ")) {
			once.Do(func() { close(e.ready) })
		}
	}}
	cmd.Stderr = &lineSink{fn: e.stderr.add}
	c, err := startChild("endpoints", cmd, true)
	if err != nil {
		return nil, err
	}
	e.child = c
	return e, nil
}

// waitReady waits until the endpoints all listen.
func (e *endpoints) waitReady(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-e.ready:
		return nil
	case <-e.done:
		return fmt.Errorf("endpoints exited (%v):\n%s", e.err, e.stderr.Tail())
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
