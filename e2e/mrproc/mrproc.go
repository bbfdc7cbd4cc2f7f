// Package mrproc builds the multireg binary and runs it as a user would: a child process with
// flags, signals and logs.
package mrproc

import (
	"bufio"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/child"
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
// the product module (the parent of this module) into a temporary directory, with the race
// detector and the build tag multireg_faults: the fault injection the tests use
// (MULTIREG_TEST_HANDOVER_PROTOCOL and MULTIREG_TEST_HANDOVER_HALT, internal/handover), which a
// release build leaves out.
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
		// the shipped binary's tags (hack/build-binary.sh), and the fault injection; its
		// node-condition agent beside it, where multireg looks for it
		for out, pkg := range map[string]string{buildPath: "./cmd/multireg", filepath.Join(dir, "multireg-nodecond"): "./cmd/multireg-nodecond"} {
			cmd := exec.Command("go", "build", "-race", "-tags", FaultTags, "-o", out, pkg)
			cmd.Dir = root
			if b, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("build %s: %v\n%s", pkg, err, b)
				return
			}
		}
	})
	return buildPath, buildErr
}

// FaultTags are the build tags of the binary Binary builds: the shipped binary's
// (hack/build-binary.sh) and multireg_faults. A binary of $MULTIREG_BIN given to the tests that
// inject faults must be built with them.
const FaultTags = "grpcnotrace,multireg_faults"

// checkFaults fails when env asks this build's binary bin (Binary's) for a fault
// (MULTIREG_TEST_…) that it is built without: it would ignore the variable, and the test would
// fail far from the cause. Earlier releases read the variables whatever their build.
func checkFaults(bin string, env []string) error {
	if own, err := Binary(); err != nil || bin != own || !slices.ContainsFunc(env, func(kv string) bool {
		return strings.HasPrefix(kv, "MULTIREG_TEST_")
	}) {
		return nil
	}
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		return err
	}
	for _, s := range bi.Settings {
		if s.Key == "-tags" && slices.Contains(strings.Split(s.Value, ","), "multireg_faults") {
			return nil
		}
	}
	return fmt.Errorf("%s is built without the tag multireg_faults (MULTIREG_BIN?): it ignores %v", bin, env)
}

var (
	releases sync.Map // revision → *release
)

type release struct {
	once sync.Once
	path string
	err  error
}

// BinaryAt returns a multireg binary built from the product's source at a git revision of
// this repository (an earlier release), once per revision and test process.
func BinaryAt(rev string) (string, error) {
	v, _ := releases.LoadOrStore(rev, &release{})
	r := v.(*release)
	r.once.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		dir, err := os.MkdirTemp("", "mrrel")
		if err != nil {
			r.err = err
			return
		}
		src := filepath.Join(dir, "src")
		if err := os.Mkdir(src, 0o755); err != nil {
			r.err = err
			return
		}
		archive := exec.Command("sh", "-c", `git -C "$1" archive --format=tar "$2" | tar -x -C "$3"`, "sh", root, rev, src)
		if out, err := archive.CombinedOutput(); err != nil {
			r.err = fmt.Errorf("git archive %s: %v\n%s", rev, err, out)
			return
		}
		r.path = filepath.Join(dir, "multireg")
		build := exec.Command("go", "build", "-o", r.path, "./cmd/multireg")
		build.Dir = src
		if out, err := build.CombinedOutput(); err != nil {
			r.err = fmt.Errorf("build multireg at %s: %v\n%s", rev, err, out)
		}
	})
	return r.path, r.err
}

// Process is a running multireg.
type Process struct {
	*child.Process
	addr atomic.Pointer[string] // the HTTP address, once logged
}

// Start runs `multireg run --config cfg --log-format json -v 1 --http-endpoint 127.0.0.1:0`
// with extra args (an --http-endpoint among them replaces the default). The process
// is killed when the test ends, if it still runs.
func Start(t testing.TB, cfg string, args ...string) *Process {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	return StartWith(t, Options{Bin: bin}, cfg, args...)
}

// Options start a multireg otherwise than Start does.
type Options struct {
	Bin string   // the binary; Binary() when empty
	Env []string // added to the environment, "KEY=value"
	// NoFile, when not 0, is the RLIMIT_NOFILE (soft and hard) multireg runs under: a shell
	// sets it, then becomes multireg.
	NoFile int
}

// StartWith is Start with opts.
func StartWith(t testing.TB, opts Options, cfg string, args ...string) *Process {
	t.Helper()
	bin := opts.Bin
	if bin == "" {
		var err error
		if bin, err = Binary(); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkFaults(bin, opts.Env); err != nil {
		t.Fatal(err)
	}
	// Port 0: tests run several multireg at once; HTTPAddr reads the port from the log.
	all := []string{"run", "--config", cfg, "--log-format", "json", "-v", "1"}
	if !slices.ContainsFunc(args, func(a string) bool { return a == "--http-endpoint" || strings.HasPrefix(a, "--http-endpoint=") }) {
		all = append(all, "--http-endpoint", "127.0.0.1:0")
	}
	all = append(all, args...)
	cmd := exec.Command(bin, all...)
	if opts.NoFile > 0 {
		cmd = exec.Command("sh", append([]string{"-c", `ulimit -n "$0" && exec "$@"`, strconv.Itoa(opts.NoFile), bin}, all...)...)
	}
	if len(opts.Env) > 0 {
		cmd.Env = append(os.Environ(), opts.Env...)
	}
	c, err := child.Start("multireg", cmd)
	if err != nil {
		t.Fatal(err)
	}
	p := &Process{Process: c}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("multireg %s logs:\n%s", strings.Join(all, " "), p.Logs())
		}
	})
	return p
}

// Signal sends sig to the process.
func (p *Process) Signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
}

// Wait waits up to timeout for the process to exit and returns its exit code (the negated
// signal number if a signal ended it).
func (p *Process) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	code, err := p.Process.Wait(timeout)
	if err != nil {
		t.Fatal(err)
	}
	return code
}

// HTTPAddr returns the address the process serves HTTP on, once it has logged it, or "".
// Once found, it is kept: the logs of 200 drivers at -v 1 are long, and parsing them on
// every poll takes enough CPU on two cores to slow multireg and kubelet down.
func (p *Process) HTTPAddr() string {
	if a := p.addr.Load(); a != nil {
		return *a
	}
	for _, r := range p.Records() {
		if r["msg"] == "serving HTTP" {
			a, _ := r["address"].(string)
			p.addr.Store(&a)
			return a
		}
	}
	return ""
}

// Logs returns everything the process wrote so far.
func (p *Process) Logs() string { return p.Output() }

// Records returns the JSON log records written so far.
func (p *Process) Records() []map[string]any {
	var recs []map[string]any
	sc := bufio.NewScanner(strings.NewReader(p.Logs()))
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
