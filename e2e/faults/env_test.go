// Package faults injects faults into a running multireg — in kubelet, in the drivers'
// endpoints, in the registration directory, in the drivers file and in the process itself —
// against the real kubelet plugin manager (1.36 with go.mod, 1.35 with kube135/go.mod), and
// asserts for each that multireg recovers and that nothing else moved. TestSoak runs a bounded
// chaos of the cheap-to-heal faults over more than 200 drivers (-soak sets its duration).
package faults

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

var soakDuration = flag.Duration("soak", 90*time.Second, "how long TestSoak injects faults (at most 5m in CI; longer needs a larger -timeout)")

func TestMain(m *testing.M) {
	flag.Parse()
	if _, err := mrproc.Binary(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// Timeouts, generous for a loaded 2-core machine: kubelet's reconciler runs once a second and
// backs off after failures (1, 2, 3, 5, 9 s …). Every wait is a poll with one of these
// deadlines; the assertions of "nothing happens" (wait.Never) hold for quietPeriod.
const (
	registerTimeout = testenv.RegisterTimeout
	exitTimeout     = testenv.ExitTimeout
	quietPeriod     = 3 * time.Second
	// requestPoll paces the waits whose every look costs multireg a request (GET /status).
	requestPoll = 100 * time.Millisecond
)

// env is one test's node (testenv.Env) with the faults' own helpers.
type env struct{ *testenv.Env }

type driver = testenv.Driver

// newEnv makes a node with a running kubelet.
func newEnv(t *testing.T) *env { return &env{testenv.New(t)} }

// newEnvWithoutKubelet makes a node whose kubelet is not running yet (StartKubelet starts it).
func newEnvWithoutKubelet(t *testing.T) *env { return &env{testenv.NewWithoutKubelet(t)} }

// startAll starts the endpoints of ds, writes the drivers file, runs multireg on it and waits
// until kubelet and multireg both have every driver registered.
func (e *env) startAll(ds []driver, args ...string) *mrproc.Process {
	e.T.Helper()
	e.StartEndpoints(ds)
	p := mrproc.Start(e.T, e.WriteConfig(ds), args...)
	e.waitRegistered(p, ds)
	return p
}

// waitRegistered waits until kubelet has registered every driver of ds and multireg reports
// each Registered.
func (e *env) waitRegistered(p *mrproc.Process, ds []driver) {
	e.T.Helper()
	wait.For(e.T, registerTimeout, fmt.Sprintf("%d drivers registered in kubelet", len(ds)), func() bool { return e.AllRegistered(ds) })
	waitPhases(e.T, p, ds, "Registered")
}

// snapshot is what kubelet and the file system say about some drivers at one moment.
type snapshot struct {
	counts map[string]kubelet.Counts
	ids    map[string]fileid.ID
}

func (e *env) snap(ds []driver) snapshot {
	s := snapshot{counts: map[string]kubelet.Counts{}, ids: map[string]fileid.ID{}}
	for _, d := range ds {
		s.counts[d.Name] = e.K.Counts(d.Name)
		s.ids[d.Name] = fileid.Of(e.Socket(d))
	}
	return s
}

// moved describes how the drivers of ds differ from the snapshot (in kubelet: a call of any
// kind, a registration lost; on disk: the socket recreated), or "" if none moved.
func (e *env) moved(s snapshot, ds []driver) string {
	var diffs []string
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c != s.counts[d.Name] {
			diffs = append(diffs, fmt.Sprintf("%s: kubelet calls %+v → %+v", d.Name, s.counts[d.Name], c))
		}
		if !e.K.Registered(d.Name) {
			diffs = append(diffs, d.Name+": not registered in kubelet")
		}
		if id := fileid.Of(e.Socket(d)); id != s.ids[d.Name] {
			diffs = append(diffs, fmt.Sprintf("%s: socket %+v → %+v", d.Name, s.ids[d.Name], id))
		}
	}
	return strings.Join(diffs, "\n")
}

// assertUnmoved fails the test if a driver of ds moved since the snapshot.
func (e *env) assertUnmoved(s snapshot, ds []driver) {
	e.T.Helper()
	if m := e.moved(s, ds); m != "" {
		e.T.Errorf("drivers that the fault did not concern moved:\n%s", m)
	}
}

// holdUnmoved asserts for quietPeriod that no driver of ds moves.
func (e *env) holdUnmoved(s snapshot, ds []driver) {
	e.T.Helper()
	var why string
	wait.Never(e.T, quietPeriod, "a driver that the fault did not concern moved", func() bool {
		why = e.moved(s, ds)
		if why != "" {
			e.T.Log(why)
		}
		return why != ""
	})
}
