package registration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// A rolling update of multireg: the running instance hands its listening sockets to the new
// one, and kubelet's plugin manager sees nothing at all.

// lastRelease is the last commit before hand-overs: a release that neither serves nor asks for
// one.
const lastRelease = "4465133"

// v010 is release v0.1.0, which speaks hand-over protocol 1 only.
const v010 = "66a839f"

// Log lines of a hand-over.
const (
	msgTookOver   = "took over the registration directory from the previous instance"
	msgHanded     = "handed over the registration directory; this instance serves nothing now and exits on SIGTERM"
	msgHalted     = "hand-over halted for a test"
	msgStandby    = "standing by: ready, and serving nothing until the directory is free"
	msgServing    = "serving the registration directory"
	msgNoHandover = "no hand-over; waiting for the previous instance to exit"
)

// sockets is the identity of every driver's registration socket: inode and change time.
type sockets map[string]string

func (e *env) sockets(ds []driver) sockets {
	ids := sockets{}
	for _, d := range ds {
		var st syscall.Stat_t
		if err := syscall.Lstat(e.Socket(d), &st); err != nil {
			ids[d.Name] = err.Error()
			continue
		}
		ids[d.Name] = fmt.Sprintf("%d/%d.%d", st.Ino, st.Ctim.Sec, st.Ctim.Nsec)
	}
	return ids
}

// moved lists the drivers whose socket is another file in now than in before.
func moved(before, now sockets) []string {
	var ms []string
	for name, id := range before {
		if now[name] != id {
			ms = append(ms, name)
		}
	}
	return ms
}

// answering reports whether every driver's registration socket answers GetInfo with the
// driver's name: a process accepts on it.
func (e *env) answering(ds []driver) bool {
	for _, d := range ds {
		if getInfo(e.Socket(d)) != d.Name {
			return false
		}
	}
	return true
}

// getInfo asks a registration socket GetInfo, as kubelet does, and returns the plugin name,
// or "" without an answer within a second.
func getInfo(path string) string {
	conn, err := grpc.NewClient("unix:"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return ""
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		return ""
	}
	return info.Name
}

// stopIdle stops idle instances with SIGTERM: each exits 0.
func stopIdle(t *testing.T, ps ...*mrproc.Process) {
	t.Helper()
	for _, p := range ps {
		p.Signal(t, syscall.SIGTERM)
		if code := p.Wait(t, exitTimeout); code != 0 {
			t.Errorf("an idle instance exited %d on SIGTERM, want 0", code)
		}
	}
}

// untouched checks, a few of kubelet's reconcile passes after a hand-over, that kubelet's
// plugin manager was not called since it had been events times, and that every socket of ds
// is still the file it was in before, and answers.
func (e *env) untouched(t *testing.T, ds []driver, before sockets, events int) {
	t.Helper()
	wait.Never(t, 3*time.Second, "kubelet to see a hand-over", func() bool { return len(e.K.Events()) != events })
	if es := e.K.Events(); len(es) != events {
		t.Errorf("kubelet's plugin manager was called %d times during the hand-over:%s", len(es)-events, kubelet.FormatEvents(es[events:]))
	}
	if m := moved(before, e.sockets(ds)); len(m) > 0 {
		t.Errorf("sockets replaced by the hand-over: %v", m)
	}
	if !e.answering(ds) {
		t.Error("a registration socket does not answer after the hand-over")
	}
}

// registeredEverywhere reports whether kubelet holds every driver and p says Registered for
// each in /status.
func registeredEverywhere(t *testing.T, e *env, p *mrproc.Process, ds []driver) bool {
	if !e.AllRegistered(ds) {
		return false
	}
	st := p.Status(t)
	for _, d := range ds {
		if s, ok := st.Driver(d.Name); !ok || s.Phase != "Registered" {
			return false
		}
	}
	return true
}

// handoverFleet starts n drivers of every type and a first multireg that registers them.
func handoverFleet(t *testing.T, n int, opts mrproc.Options) (*env, []driver, *mrproc.Process) {
	e := newEnv(t)
	ds := testenv.Mixed("", n)
	e.StartEndpoints(ds)
	first := mrproc.StartWith(t, opts, e.WriteConfig(ds))
	wait.For(t, registerTimeout, "every driver registered", func() bool { return registeredEverywhere(t, e, first, ds) })
	return e, ds, first
}

// 1. A second multireg with the same file takes every socket over: kubelet's plugin manager
// is not called once, every socket keeps its inode, and the first instance is idle, then
// exits 0 on SIGTERM.
func TestHandover(t *testing.T) {
	t.Parallel()
	e, ds, first := handoverFleet(t, 100, mrproc.Options{})
	before, events := e.sockets(ds), len(e.K.Events())

	start := time.Now()
	second := mrproc.Start(t, e.Cfg)
	wait.For(t, registerTimeout, "the second instance to take over", func() bool { return second.Count(msgServing, "") == 1 })
	t.Logf("the second instance served every socket %s after it started", time.Since(start).Round(time.Millisecond))
	wait.For(t, registerTimeout, "the first instance to say it handed over", func() bool { return first.Count(msgHanded, "") == 1 })
	if !e.answering(ds) {
		t.Error("a registration socket does not answer after the hand-over")
	}
	st := second.Status(t)
	if st.Instance.Role != "serving" || st.Instance.Inherited != len(ds) {
		t.Errorf("second instance: %+v, want serving with %d sockets taken over", st.Instance, len(ds))
	}
	for _, d := range ds {
		if s, _ := st.Driver(d.Name); s.Phase != "Registered" {
			t.Errorf("%s: %s in the second instance, want Registered", d.Name, s.Phase)
		}
	}
	if st := first.Status(t); st.Instance.Role != "idle" || len(st.Drivers) != 0 {
		t.Errorf("first instance: %+v with %d drivers, want idle with none", st.Instance, len(st.Drivers))
	}
	if code, body, err := first.Get(t, "/readyz"); err != nil || code != 200 {
		t.Errorf("the idle instance's /readyz: %d %s %v", code, body, err)
	}
	// Whatever kubelet's reconciler would do, it has done within a few passes.
	wait.Never(t, 3*time.Second, "kubelet to see the hand-over", func() bool { return len(e.K.Events()) != events })

	stopIdle(t, first)
	e.untouched(t, ds, before, events)
}

// 2. With one driver registered differently in the new instance's file, only that driver is
// registered again.
func TestHandoverOneDriverChanged(t *testing.T) {
	t.Parallel()
	e, ds, _ := handoverFleet(t, 30, mrproc.Options{})
	before := e.Registrations(ds)
	changed := ds[0] // a CSI driver: its versions are its registration
	ds2 := append([]driver{}, ds...)
	ds2[0].Extra = "    supportedVersions: [\"1.0.0\", \"1.1.0\"]\n"
	cfg2 := e.Dir + "/cfg2.yaml"
	if err := os.WriteFile(cfg2, []byte(e.ConfigContent(ds2)), 0o644); err != nil {
		t.Fatal(err)
	}
	second := mrproc.Start(t, cfg2)
	wait.For(t, registerTimeout, "the changed driver registered again", func() bool {
		return e.K.Counts(changed.Name).Registrations == before[changed.Name]+1 && e.K.Registered(changed.Name) && registeredEverywhere(t, e, second, ds)
	})
	wait.Never(t, 3*time.Second, "another driver to be registered again", func() bool {
		for _, d := range ds[1:] {
			if c := e.K.Counts(d.Name); c.Registrations != before[d.Name] || c.Deregistrations != 0 {
				return true
			}
		}
		return false
	})
	if n := second.Status(t).Instance.Inherited; n != len(ds)-1 {
		t.Errorf("%d sockets taken over, want %d", n, len(ds)-1)
	}
}

// 3. Either side killed at each step of the hand-over: the survivor ends with every driver
// registered and every socket listening, and only what had to move moved: the sockets the new
// instance never received, when the holder died before it sent them.
func TestHandoverKilledAtEachStep(t *testing.T) {
	t.Parallel()
	const n = 70 // two batches: the first carries 64 drivers
	for _, tt := range []struct {
		side, step string
		// moved: how many drivers end on a new socket, registered once more; -1: those the
		// first batch did not carry (the holder logs how many it did).
		moved int
	}{
		{"holder", "stopped", n}, // the new instance received nothing: it publishes every socket
		{"holder", "batch", -1},
		{"holder", "released", 0},
		{"new", "hello", 0}, // nothing paused (protocol 2)
		{"new", "take", 0},  // the holder paused, then resumes
		{"new", "batch", 0},
		{"new", "received", 0},
		{"new", "acked", 0}, // the idle holder takes its sockets back
	} {
		t.Run(tt.side+"-"+tt.step, func(t *testing.T) {
			t.Parallel()
			halt := mrproc.Options{Env: []string{"MULTIREG_TEST_HANDOVER_HALT=" + tt.side + ":" + tt.step}}
			var holderOpts, newOpts mrproc.Options
			if tt.side == "holder" {
				holderOpts = halt
			} else {
				newOpts = halt
			}
			e, ds, holder := handoverFleet(t, n, holderOpts)
			before, counts := e.sockets(ds), e.Registrations(ds)
			next := mrproc.StartWith(t, newOpts, e.Cfg)
			halted, survivor := holder, next
			if tt.side == "new" {
				halted, survivor = next, holder
			}
			wait.For(t, registerTimeout, "the hand-over to halt at "+tt.step, func() bool { return halted.Count(msgHalted, "") == 1 })
			var h *kubelet.Hold
			if tt.moved == n {
				// Every socket is published anew: a DRA driver's while kubelet's reconciler is
				// between its two loops.
				h = e.holdPass(t, ds[1])
			}
			halted.Signal(t, syscall.SIGKILL)
			halted.Wait(t, exitTimeout)
			if h != nil {
				e.heldUntilChanged(t, h)
			}
			want := tt.moved
			if want < 0 {
				for _, r := range halted.Records() {
					if r["msg"] == msgHalted {
						sent, _ := r["drivers"].(float64)
						want = n - int(sent)
					}
				}
				if want <= 0 || want >= n {
					t.Fatalf("the holder halted after a first batch of %d drivers of %d: not a partial hand-over", n-want, n)
				}
			}

			wait.For(t, registerTimeout, "the survivor to serve every driver, registered", func() bool {
				return registeredEverywhere(t, e, survivor, ds) && e.answering(ds)
			})
			m := moved(before, e.sockets(ds))
			if len(m) != want {
				t.Errorf("%d sockets replaced, want %d: %v", len(m), want, m)
			}
			wait.Never(t, 3*time.Second, "a driver registered more than once more", func() bool {
				again := 0
				for _, d := range ds {
					switch e.K.Counts(d.Name).Registrations - counts[d.Name] {
					case 0:
					case 1:
						again++
					default:
						return true
					}
				}
				return again != want
			})
			if survivor.Exited() {
				t.Error("the survivor exited")
			}
		})
	}
}

// 4. A chain of hand-overs, A → B → C → D: kubelet sees none of them; each earlier instance is
// idle and exits 0 on SIGTERM.
func TestHandoverChain(t *testing.T) {
	t.Parallel()
	e, ds, a := handoverFleet(t, 30, mrproc.Options{})
	before, events := e.sockets(ds), len(e.K.Events())
	chain := []*mrproc.Process{a}
	for range 3 {
		p := mrproc.Start(t, e.Cfg)
		wait.For(t, registerTimeout, "the next instance to take over", func() bool { return p.Count(msgServing, "") == 1 })
		prev := chain[len(chain)-1]
		wait.For(t, registerTimeout, "the previous one to be idle", func() bool { return prev.Count(msgHanded, "") == 1 })
		chain = append(chain, p)
	}
	last := chain[len(chain)-1]
	wait.For(t, registerTimeout, "every driver Registered in the last instance", func() bool { return registeredEverywhere(t, e, last, ds) })
	stopIdle(t, chain[:len(chain)-1]...)
	e.untouched(t, ds, before, events)
}

// 5. No hand-over: the holder is the last release, which neither serves nor asks for one, or
// speaks another hand-over protocol version and refuses. The new instance says why and stands
// by — ready, serving no socket — and takes over when the holder exits, registering every
// driver once more: the cost of an upgrade before hand-overs.
func TestHandoverFallsBack(t *testing.T) {
	t.Parallel()
	old, err := mrproc.BinaryAt(lastRelease)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name             string
		holder, newcomer mrproc.Options
		why              string // in the standby's status
	}{
		{"last release", mrproc.Options{Bin: old}, mrproc.Options{}, "no instance answers hand-over requests"},
		{"another protocol version", mrproc.Options{}, mrproc.Options{Env: []string{"MULTIREG_TEST_HANDOVER_PROTOCOL=3"}}, "versions"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e, ds, first := handoverFleet(t, 6, tt.holder)
			counts := e.Registrations(ds)
			second := mrproc.StartWith(t, tt.newcomer, e.Cfg)
			wait.For(t, registerTimeout, "the new instance to stand by", func() bool {
				return second.Count(msgNoHandover, "") == 1 && second.Count(msgStandby, "") == 1 &&
					second.Count("another multireg holds the registration directory; waiting for it to exit", "") == 1
			})
			if st := second.Status(t); st.Instance.Role != "standby" || !strings.Contains(st.Instance.Detail, tt.why) {
				t.Errorf("the new instance: %+v, want standby saying %q", st.Instance, tt.why)
			}
			if code, body, err := second.Get(t, "/readyz"); err != nil || code != 200 || !strings.Contains(body, "standby") {
				t.Errorf("the standby's /readyz: %d %q %v, want 200 and standby", code, body, err)
			}
			wait.Never(t, 2*time.Second, "kubelet to see anything while the new instance stands by", func() bool {
				return fmt.Sprint(e.Registrations(ds)) != fmt.Sprint(counts)
			})
			first.Signal(t, syscall.SIGTERM)
			if code := first.Wait(t, exitTimeout); code != 0 {
				t.Errorf("the holder exited %d", code)
			}
			wait.For(t, registerTimeout, "the standby to take over and register every driver once more", func() bool {
				return e.registeredAgain(ds, counts) && registeredEverywhere(t, e, second, ds) &&
					second.Count("took over the registration directory", "") == 1
			})
			if second.Exited() {
				t.Error("the new instance exited")
			}
		})
	}
}

// 5b. Hand-overs between releases: v0.1.0 speaks protocol 1, this release 1 and 2. An upgrade
// from v0.1.0 and a rollback to it hand every socket over in version 1, and two instances of
// this release in version 2; kubelet sees none of them.
func TestHandoverAcrossReleases(t *testing.T) {
	t.Parallel()
	old, err := mrproc.BinaryAt(v010)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name             string
		holder, newcomer mrproc.Options
		version          float64 // the one the holder picks
	}{
		{"upgrade from v0.1.0", mrproc.Options{Bin: old}, mrproc.Options{}, 1},
		{"rollback to v0.1.0", mrproc.Options{}, mrproc.Options{Bin: old}, 1},
		{"this release", mrproc.Options{}, mrproc.Options{}, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e, ds, first := handoverFleet(t, 20, tt.holder)
			before, events := e.sockets(ds), len(e.K.Events())
			second := mrproc.StartWith(t, tt.newcomer, e.Cfg)
			wait.For(t, registerTimeout, "the second instance to take over", func() bool { return second.Count(msgTookOver, "") == 1 })
			wait.For(t, registerTimeout, "the first instance to say it handed over", func() bool { return first.Count(msgHanded, "") == 1 })
			var version float64
			for _, r := range first.Records() {
				if r["msg"] == "handing over the registration directory to a new instance" {
					version, _ = r["version"].(float64)
				}
			}
			if version != tt.version {
				t.Errorf("handed over in protocol version %v, want %v", version, tt.version)
			}
			if !e.answering(ds) {
				t.Error("a registration socket does not answer after the hand-over")
			}
			wait.Never(t, 3*time.Second, "kubelet to see the hand-over", func() bool { return len(e.K.Events()) != events })
			if m := moved(before, e.sockets(ds)); len(m) > 0 {
				t.Errorf("sockets replaced or removed: %v", m)
			}
			stopIdle(t, first)
		})
	}
}

// 6. A verdict kubelet owes when the hand-over happens reaches the new instance: kubelet is
// still registering the driver (GetInfo answered by the old instance), and the new one counts
// its verdict, on a connection of kubelet's own. No second registration, no timeout.
func TestHandoverPendingVerdict(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := driver{Name: "slow.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(d)
	e.K.SetRegisterDelay(d.Name, 8*time.Second) // ample for a second process to start on a loaded machine
	cfg := e.WriteConfig([]driver{d})
	first := mrproc.Start(t, cfg)
	wait.For(t, registerTimeout, "kubelet to ask GetInfo", func() bool { return first.Count("kubelet called GetInfo", d.Name) == 1 })
	second := mrproc.Start(t, cfg)
	wait.For(t, registerTimeout, "the hand-over", func() bool { return second.Count(msgServing, "") == 1 })
	if first.Count("phase changed", d.Name) > 1 {
		t.Fatal("the first instance had its verdict before the hand-over: the delay was too short to test anything")
	}
	wait.For(t, registerTimeout, "the new instance to count kubelet's verdict", func() bool { return registeredEverywhere(t, e, second, []driver{d}) })
	if c := e.K.Counts(d.Name); c.Registrations != 1 || c.Deregistrations != 0 {
		t.Errorf("kubelet: %+v, want one registration", c)
	}
	if st, _ := second.Status(t).Driver(d.Name); st.Attempts != 1 || st.Failures != 0 {
		t.Errorf("the new instance: %+v, want the one attempt, no failure", st)
	}
}

// 7. The successor stopped cleanly (SIGTERM, as `systemctl stop` of the new unit): it exits 0
// leaving its sockets, and the idle predecessor stays idle instead of taking the directory
// back (it does after a crash: 3). kubelet sees nothing, and the idle one exits 0 on SIGTERM.
func TestHandoverSuccessorStopped(t *testing.T) {
	t.Parallel()
	e, ds, first := handoverFleet(t, 10, mrproc.Options{})
	before, events := e.sockets(ds), len(e.K.Events())
	second := mrproc.Start(t, e.Cfg)
	wait.For(t, registerTimeout, "the second instance to take over", func() bool { return second.Count(msgServing, "") == 1 })
	wait.For(t, registerTimeout, "the first instance to say it handed over", func() bool { return first.Count(msgHanded, "") == 1 })

	second.Signal(t, syscall.SIGTERM)
	if code := second.Wait(t, exitTimeout); code != 0 {
		t.Errorf("the successor exited %d on SIGTERM, want 0", code)
	}
	wait.Never(t, 3*time.Second, "the idle instance to serve again", func() bool { return first.Count(msgServing, "") > 1 })
	if st := first.Status(t); st.Instance.Role != "idle" || !strings.Contains(st.Instance.Detail, "stopped (not crashed)") {
		t.Errorf("first instance: %+v, want idle, saying its successor was stopped", st.Instance)
	}
	if es := e.K.Events(); len(es) != events {
		t.Errorf("kubelet's plugin manager was called %d times:%s", len(es)-events, kubelet.FormatEvents(es[events:]))
	}
	if m := moved(before, e.sockets(ds)); len(m) > 0 {
		t.Errorf("sockets replaced or removed: %v", m)
	}
	stopIdle(t, first)
}

// 1b. The new instance reaches every endpoint by another path (localEndpoint through a
// symbolic link to the endpoints' directory), which kubelet never sees: every socket is taken
// over and kubelet is not called once, a CSI driver never leaves its registration, nor a DRA
// driver or a device plugin theirs. (The new instance took the path for a newer instance and
// registered every driver again: a CSI driver was out for 1.0 s, a DRA driver for 2.0 s.)
func TestHandoverWithAnotherLocalEndpoint(t *testing.T) {
	t.Parallel()
	e, ds, first := handoverFleet(t, 6, mrproc.Options{})
	before, events := e.sockets(ds), len(e.K.Events())
	via := filepath.Join(e.Dir, "via")
	if err := os.Symlink(filepath.Dir(e.EndpointPath(ds[0])), via); err != nil {
		t.Fatal(err)
	}
	edited := slices.Clone(ds)
	for i := range edited {
		edited[i].Extra += fmt.Sprintf("    localEndpoint: %s\n", filepath.Join(via, filepath.Base(e.EndpointPath(ds[i]))))
	}
	e.WriteConfig(edited)
	second := mrproc.Start(t, e.Cfg)
	wait.For(t, registerTimeout, "the second instance to take over", func() bool { return second.Count(msgServing, "") == 1 })
	wait.For(t, registerTimeout, "the first instance to say it handed over", func() bool { return first.Count(msgHanded, "") == 1 })
	wait.For(t, registerTimeout, "every driver Registered in the second instance, its endpoint probed", func() bool {
		st := second.Status(t)
		for _, d := range ds {
			if s, _ := st.Driver(d.Name); s.Phase != "Registered" || !s.EndpointUp {
				return false
			}
		}
		return true
	})
	wait.Never(t, 2*time.Second, "kubelet called", func() bool { return len(e.K.Events()) != events })
	if m := moved(before, e.sockets(ds)); len(m) > 0 {
		t.Errorf("sockets replaced: %v", m)
	}
	for _, d := range ds {
		if gap := longestAbsence(e.K.EventsFor(d.Name)); gap != 0 {
			t.Errorf("kubelet held no registration of %s for %s", d.Name, gap)
		}
	}
}

// 5c. A rollback to v0.1.0 with a DRA driver registered at its second path (after a restart of
// multireg without a hand-over). v0.1.0 gives a DRA driver with a fixed endpoint one path
// only, and refuses a socket handed over at another: the old pod withdraws that socket itself
// once the hand-over is acknowledged, before it releases the directory, and v0.1.0 registers
// the driver at its first path. Nothing is left at the second path for kubelet to keep (which
// would have its DRA manager refuse the driver's endpoint for good), and the CSI driver beside
// it is handed over untouched.
func TestRollbackWithADRADriverAtItsSecondPath(t *testing.T) {
	t.Parallel()
	old, err := mrproc.BinaryAt(v010)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	dra := driver{Name: "moved.example.com", Type: "DRAPlugin"}
	csi := driver{Name: "csi.example.com", Type: "CSIPlugin"}
	ds := []driver{dra, csi}
	p := e.registeredByNextRun(t, ds, e.killedAfterRegistration(t, ds))
	if !testenv.IsSocket(e.AltSocketPath(dra)) || testenv.IsSocket(e.SocketPath(dra)) {
		t.Fatalf("the DRA driver's socket is not at its second path %s alone", e.AltSocketPath(dra))
	}
	csiBefore, draBefore := e.sockets([]driver{csi}), len(e.K.EventsFor(dra.Name))
	csiEvents := len(e.K.EventsFor(csi.Name))

	v010p := mrproc.StartWith(t, mrproc.Options{Bin: old}, e.Cfg)
	wait.For(t, registerTimeout, "v0.1.0 to take over", func() bool { return v010p.Count(msgTookOver, "") == 1 })
	wait.For(t, registerTimeout, "this release to say it handed over", func() bool { return p.Count(msgHanded, "") == 1 })
	wait.For(t, registerTimeout, "the DRA driver registered by v0.1.0 at its first path", func() bool {
		return testenv.IsSocket(e.SocketPath(dra)) && e.K.Registered(dra.Name) && registeredEverywhere(t, e, v010p, ds)
	})
	if _, err := os.Lstat(e.AltSocketPath(dra)); !os.IsNotExist(err) {
		t.Errorf("%s after the rollback: %v, want nothing there", e.AltSocketPath(dra), err)
	}
	wait.Never(t, 3*time.Second, "kubelet to drop the DRA driver again", func() bool { return !e.K.Registered(dra.Name) })
	events := e.K.EventsFor(dra.Name)[draBefore:]
	t.Logf("kubelet %s held no registration of %s for %s in the rollback:%s", kubelet.Version(), dra.Name, longestAbsence(events), kubelet.FormatEvents(events))
	if c := len(e.K.EventsFor(csi.Name)); c != csiEvents {
		t.Errorf("kubelet's plugin manager was called for the CSI driver in the rollback:%s", kubelet.FormatEvents(e.K.EventsFor(csi.Name)[csiEvents:]))
	}
	if m := moved(csiBefore, e.sockets([]driver{csi})); len(m) > 0 {
		t.Errorf("the CSI driver's socket replaced by the rollback")
	}
	stopIdle(t, p)
}
