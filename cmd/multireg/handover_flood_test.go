//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

// childArgs, in the environment of this test binary, makes TestMultiregChild run `multireg`
// with these arguments (separated by newlines) as a process of its own: what a benchmark
// measures from outside.
const childArgs = "MULTIREG_TEST_CHILD_ARGS"

// TestMultiregChild is `multireg` in a child process (childArgs); otherwise it does nothing.
func TestMultiregChild(t *testing.T) {
	args := os.Getenv(childArgs)
	if args == "" {
		t.Skip("only as a child process of a test or benchmark")
	}
	err := run(context.Background(), strings.Split(args, "\n"), os.Stdin, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(exitCode(err))
	}
	os.Exit(0)
}

// BenchmarkHandOverFlood measures what a predecessor that hands over far more drivers than the
// new instance configures costs the new instance, a `multireg run` of two drivers in a process of
// its own (this test binary, run as TestMultiregChild): its peak RSS (VmHWM), the most
// descriptors it held (/proc/PID/fd, read every few milliseconds) and its log lines, from its
// start until it serves the directory and has withdrawn what it withdraws. The predecessor is
// the benchmark itself, a fake holder that hands over n drivers none of which the new instance
// configures, each with one listening registration socket ("sockets") or none, in batches of 64
// (protocol version 2), and records their sockets as multireg's own (.multireg.sockets), as a
// real holder does. Once the new instance answers, the holder ends: it closes its copies and the
// lock.
//
// Run it without -race (the race detector multiplies memory):
//
//	go test -run '^$' -bench HandOverFlood -benchtime 1x ./cmd/multireg
func BenchmarkHandOverFlood(b *testing.B) {
	for _, tt := range []struct {
		n       int
		sockets bool
	}{{0, false}, {50000, false}, {10000, true}} {
		name := fmt.Sprintf("drivers=%d/sockets=%v", tt.n, tt.sockets)
		b.Run(name, func(b *testing.B) {
			for range b.N {
				r := handOverFlood(b, tt.n, tt.sockets)
				b.ReportMetric(float64(r.hwmKiB)/1024, "peak-RSS-MiB")
				b.ReportMetric(float64(r.maxFDs), "max-fds")
				b.ReportMetric(float64(r.lines), "log-lines")
				b.ReportMetric(float64(r.info), "info-lines")
				b.ReportMetric(float64(r.left), "sockets-left")
				b.Logf("%s: answer %s; peak RSS %.1f MiB, at most %d fds, %d log lines (%d INFO, %d WARN); %d of the %d sockets still in the directory",
					name, r.answer, float64(r.hwmKiB)/1024, r.maxFDs, r.lines, r.info, r.warn, r.left, r.handedSockets)
			}
		})
	}
}

// floodResult is what handOverFlood measured.
type floodResult struct {
	answer              string // the new instance's answer to the batches
	hwmKiB              int
	maxFDs              int
	lines, info, warn   int
	left, handedSockets int
}

// handOverFlood hands n drivers none of which it configures over to a new `multireg run` of two
// drivers, in a child process, and measures it (BenchmarkHandOverFlood).
func handOverFlood(b *testing.B, n int, sockets bool) floodResult {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	if sockets && lim.Cur < uint64(n)+100 {
		b.Skipf("RLIMIT_NOFILE %d: too few descriptors for the %d sockets the holder hands over", lim.Cur, n)
	}
	dir := testkit.ShortDir(b)
	reg := filepath.Join(dir, "reg")
	if err := os.MkdirAll(reg, 0o750); err != nil {
		b.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(reg, regdir.LockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b.Fatal(err)
	}

	// The drivers handed over, and their sockets: listening, each a file in reg.
	var drivers []*handover.Driver
	var files []*os.File
	defer func() { handover.CloseAll(files) }()
	var names []string
	for i := range n {
		d := config.Driver{Registration: config.Registration{Name: fmt.Sprintf("flood-%d.example.com", i), Type: config.DRAPlugin,
			Endpoint: fmt.Sprintf("/var/lib/kubelet/plugins/flood-%d/dra.sock", i)}}
		d.SocketName = d.Name + "-reg.sock"
		d.SocketPath = filepath.Join(reg, d.SocketName)
		hd := &handover.Driver{Spec: d, Endpoint: d.Endpoint, Status: handover.Status{Phase: "WaitingForEndpoint",
			LastError: "endpoint " + d.Endpoint + ": connect: no such file or directory", Results: map[string]int{"rejected": 1}}}
		if sockets {
			l, err := testkit.ListenUnlinked(d.SocketPath)
			if err != nil {
				b.Fatal(err)
			}
			f, err := l.File()
			l.Close() // f keeps it listening
			if err != nil {
				b.Fatal(err)
			}
			files = append(files, f)
			id, _, err := fsid.Stat(d.SocketPath)
			if err != nil {
				b.Fatal(err)
			}
			hd.Sockets = []*handover.Socket{{Path: d.SocketPath, ID: id, Generation: 1, Registered: true, Endpoint: d.Endpoint, File: f}}
			names = append(names, d.SocketName)
		}
		drivers = append(drivers, hd)
	}
	record := "# Registration sockets owned by multireg; it removes those no longer configured.\n" + strings.Join(names, "\n") + "\n"
	if err := os.WriteFile(filepath.Join(reg, regdir.OwnedName), []byte(record), 0o600); err != nil {
		b.Fatal(err)
	}

	l, err := handover.Listen(reg)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	cfgPath := filepath.Join(dir, "drivers.yaml")
	cfg := `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
registrationDir: ` + reg + `
drivers:
  - {name: vendor.example/gpu, type: DevicePlugin, endpoint: ` + filepath.Join(dir, "ep", "dp.sock") + `}
  - {name: gpu.example.com, type: DRAPlugin, endpoint: ` + filepath.Join(dir, "ep", "dra.sock") + `}
`
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	var logs testkit.Buffer
	cmd := exec.Command(os.Args[0], "-test.run=^TestMultiregChild$")
	cmd.Env = append(os.Environ(), childArgs+"="+strings.Join([]string{"run", "--config", cfgPath, "--log-format", "json", "--http-endpoint", ""}, "\n"))
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	}()
	pid := cmd.Process.Pid
	// The most descriptors the child holds, read until it is measured.
	maxFDs := make(chan int, 1)
	stopFDs := make(chan struct{})
	go func() {
		m := 0
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			if es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
				m = max(m, len(es))
			}
			select {
			case <-stopFDs:
				maxFDs <- m
				return
			case <-tick.C:
			}
		}
	}()

	answer := floodHolder(b, l, drivers, files, lock)
	// The holder ends: its copies of the sockets and the lock are closed.
	handover.CloseAll(files)
	files = nil
	lock.Close()
	testkit.Eventually(b, 2*time.Minute, "the new instance to serve the directory", func() bool {
		return strings.Contains(logs.String(), `"msg":"serving the registration directory"`)
	})
	// What it withdraws, it withdraws once it has applied its configuration: until the sockets
	// left stop changing.
	left := func() int {
		k := 0
		for _, name := range names {
			if testkit.IsSocket(filepath.Join(reg, name)) {
				k++
			}
		}
		return k
	}
	last, same := -1, 0
	testkit.Eventually(b, 2*time.Minute, "the sockets left to settle", func() bool {
		now := left()
		if now == last {
			same++
		} else {
			last, same = now, 0
		}
		return same >= 100 // half a second without change
	})
	close(stopFDs)
	r := floodResult{answer: answer, maxFDs: <-maxFDs, left: last, handedSockets: len(names)}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(string(status)) {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			r.hwmKiB, _ = strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
	sc := bufio.NewScanner(bytes.NewReader([]byte(logs.String())))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		r.lines++
		var line struct{ Level string }
		json.Unmarshal(sc.Bytes(), &line)
		switch line.Level {
		case "INFO":
			r.info++
		case "WARN":
			r.warn++
		}
	}
	return r
}

// floodHolder serves one hand-over request on l, in version 2, with drivers in batches of 64
// (their sockets' descriptors files, in order) and the lock's descriptor with the last batch.
// It returns the new instance's answer, and tells it released after an ack.
func floodHolder(b *testing.B, l *handover.Listener, drivers []*handover.Driver, files []*os.File, lock *os.File) string {
	c, err := l.AcceptUnix()
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	buf := make([]byte, 1<<20)
	read := func() string {
		n, _, _, _, err := c.ReadMsgUnix(buf, nil)
		if err != nil {
			return "read: " + err.Error()
		}
		var m handover.Msg
		json.Unmarshal(buf[:n], &m)
		if m.Reason != "" {
			return m.Type + ": " + m.Reason
		}
		return m.Type
	}
	send := func(m *handover.Msg, fs []*os.File) error {
		body, err := json.Marshal(m)
		if err != nil {
			b.Fatal(err)
		}
		var oob []byte
		if len(fs) > 0 {
			fds := make([]int, len(fs))
			for i, f := range fs {
				// Not f.Fd(), which would make the socket blocking for the new instance too.
				rc, err := f.SyscallConn()
				if err != nil {
					b.Fatal(err)
				}
				rc.Control(func(fd uintptr) { fds[i] = int(fd) })
			}
			oob = syscall.UnixRights(fds...)
		}
		_, _, err = c.WriteMsgUnix(body, oob, nil)
		return err
	}
	if hello := read(); hello != handover.MsgHello {
		b.Fatalf("the new instance said %q, want a hello", hello)
	}
	if err := send(&handover.Msg{Type: handover.MsgWelcome, Version: 2}, nil); err != nil {
		b.Fatal(err)
	}
	if take := read(); take != handover.MsgTake {
		b.Fatalf("the new instance said %q, want take", take)
	}
	fi := 0
	for i := 0; i == 0 || i < len(drivers); i += 64 {
		batch := drivers[i:min(i+64, len(drivers))]
		m := &handover.Msg{Type: handover.MsgBatch, Version: 2, Drivers: batch}
		var fs []*os.File
		for _, hd := range batch {
			fs = append(fs, files[fi:fi+len(hd.Sockets)]...)
			fi += len(hd.Sockets)
		}
		m.Sockets = len(fs)
		if i+64 >= len(drivers) {
			m.Last, m.Lock = true, true
			fs = append(fs, lock)
		}
		if err := send(m, fs); err != nil {
			// The new instance gave up, and closed the connection: its answer is read below.
			if _, ok := err.(*net.OpError); ok {
				break
			}
			b.Fatal(err)
		}
	}
	answer := read()
	if answer == handover.MsgAck {
		send(&handover.Msg{Type: handover.MsgReleased, Version: 2}, nil)
	}
	return answer
}
