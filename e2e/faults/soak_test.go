package faults

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Soak limits.
const (
	soakConfigured = 210 // drivers in the file at the start (and at the end)
	soakPool       = 240 // drivers with a running endpoint; config edits move drivers between the two
	soakMinDrivers = 201 // config edits never leave fewer in the file
	// settleTimeout bounds every other wait of the soak.
	settleTimeout = 30 * time.Second
	// scrapeGoroutines is how far go_goroutines moves from one scrape to the next with
	// nothing else changing: it counts the goroutines serving the scrape itself, and the
	// registry gathers its five collectors on one to five worker goroutines, more when the
	// machine is loaded (60 scrapes of an idle multireg read 18 to 21; a CI run under load
	// read 3 above the baseline for the whole settle, with a goroutine dump showing nothing
	// but every driver's two goroutines and the fixed ones). A leak per fault or per round
	// of the soak exceeds it many times over.
	scrapeGoroutines = 4
)

// healDeadline: after each fault of the soak heals, every configured driver (all endpoints are
// up then) is registered in kubelet within this.
var healDeadline = flag.Duration("soak-heal", 5*time.Second, "TestSoak: how soon after each fault heals every driver must be registered again")

// The faults of the soak: the ones cheap to heal.
const (
	faultEndpoint      = "endpoint-dies-and-returns"
	faultSocketDeleted = "socket-deleted"
	faultSocketFile    = "socket-replaced-by-file"
	faultRejected      = "kubelet-rejects"
	faultKubelet       = "kubelet-restart"
	faultConfigEdit    = "config-edit"
	faultConfigInvalid = "config-invalid-then-valid"
)

// TestSoak runs a bounded chaos over more than 200 drivers of all types for -soak (90s by
// default): rounds of random faults, either one to three per-driver faults at once on
// distinct drivers, or one global fault. After each round heals, every configured driver must
// be registered in kubelet within healDeadline, and no driver outside the file may be. At the
// end the process holds as many goroutines, fds and inotify watches as at the start, and
// every file multireg does not own is still there: a sentinel file, a file named like one of
// multireg's temporary sockets, a live and a dead foreign socket in the registry directory,
// and each file put in place of a socket, until the test removed it.
func TestSoak(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	s := &soak{
		t:       t,
		e:       e,
		rng:     rand.New(rand.NewPCG(seed, 1)),
		tweaked: map[string]bool{},
		faults:  map[string]int{},
		longest: map[string]time.Duration{},
		keep:    map[string]string{},
		ids:     map[string]fileid.ID{},
	}
	for i, d := range testenv.Mixed("z", soakPool) {
		// Endpoints in several directories: each is one more inotify watch to account for.
		d.Endpoint = filepath.Join(e.Dir, fmt.Sprintf("ep%d", i%4), testenv.Safe(d.Name)+".sock")
		s.pool = append(s.pool, d)
		e.StartEndpoint(d)
	}
	s.cfg = slices.Clone(s.pool[:soakConfigured])
	s.placeForeignFiles()

	start := time.Now()
	s.p = mrproc.Start(t, e.WriteConfig(s.cfg))
	s.waitHealed("start", start, time.Minute, nil)
	t.Logf("%d drivers registered %v after start", len(s.cfg), time.Since(start).Round(time.Millisecond))
	pid := pidOf(t, e.Cfg)
	base := s.baseline(pid)

	deadline := time.Now().Add(*soakDuration)
	rounds := 0
	for time.Now().Before(deadline) && !t.Failed() {
		rounds++
		s.round()
	}

	// Back to the file of the start: every figure must return to its baseline.
	s.cfg = slices.Clone(s.pool[:soakConfigured])
	clear(s.tweaked)
	s.writeConfig()
	s.waitWhole("the first config again")
	end := s.settle(pid, base)

	if got := pidOf(t, e.Cfg); got != pid {
		t.Errorf("multireg pid %d → %d", pid, got)
	}
	if !s.p.Healthy(t) {
		t.Error("/healthz not 200 at the end")
	}
	s.checkForeignFiles()

	var b strings.Builder
	fmt.Fprintf(&b, "soak on kubelet %s for %v: %d rounds; %d drivers configured, %d endpoints\n", kubelet.Version(), *soakDuration, rounds, len(s.cfg), len(s.pool))
	kinds := make([]string, 0, len(s.faults))
	for k := range s.faults {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	total := 0
	var worst time.Duration
	for _, k := range kinds {
		fmt.Fprintf(&b, "  %-26s %4d injected, longest heal %v\n", k, s.faults[k], s.longest[k].Round(time.Millisecond))
		total += s.faults[k]
		worst = max(worst, s.longest[k])
	}
	fmt.Fprintf(&b, "  %-26s %4d injected, longest heal %v (limit %v)\n", "all", total, worst.Round(time.Millisecond), *healDeadline)
	fmt.Fprintf(&b, "  registrations orphaned by kubelet's reconciler race, cleared by a kubelet restart: %d %v\n", len(s.orphaned), s.orphaned)
	fmt.Fprintf(&b, "  baseline: %v\n  end:      %v", base, end)
	t.Log(b.String()) // shown with -v (make soak) and on failure
}

type soak struct {
	t   *testing.T
	e   *env
	p   *mrproc.Process
	rng *rand.Rand

	pool    []driver        // every driver with an endpoint
	cfg     []driver        // the drivers in the file, in file order
	tweaked map[string]bool // drivers whose entry lists versions of its own (a change kubelet sees)

	faults   map[string]int           // injected, by kind
	longest  map[string]time.Duration // longest heal, by kind
	orphaned []string                 // registrations kubelet orphaned (see orphans)

	keep map[string]string    // files multireg does not own: path → content ("" for a socket)
	ids  map[string]fileid.ID // their identities
}

// fault is one injected fault: heal removes it, healed reports that its driver(s) are back.
type fault struct {
	kind   string
	heal   func()
	healed func() bool
}

// round injects one global fault, or one to three per-driver faults on distinct drivers,
// heals them, and waits until the node is whole again.
func (s *soak) round() {
	s.t.Helper()
	var fs []fault
	var what []string
	switch r := s.rng.IntN(10); {
	case r == 0:
		fs = append(fs, s.kubeletRestart())
	case r <= 2:
		fs = append(fs, s.configEdit())
	case r == 3:
		fs = append(fs, s.configInvalid())
	default:
		kinds := []string{faultEndpoint, faultSocketDeleted, faultSocketFile, faultRejected}
		for _, v := range s.victims(1 + s.rng.IntN(3)) {
			kind := kinds[s.rng.IntN(len(kinds))]
			fs = append(fs, s.inject(kind, v))
			what = append(what, kind+" "+v.Name)
		}
	}
	if what == nil {
		what = []string{fs[0].kind}
	}
	for _, f := range fs {
		f.heal()
	}
	healed := time.Now()
	took, orphaned := s.waitHealed(strings.Join(what, ", "), healed, settleTimeout, func() bool {
		for _, f := range fs {
			if !f.healed() {
				return false
			}
		}
		return true
	})
	for _, f := range fs {
		s.faults[f.kind]++
		if orphaned == nil {
			s.longest[f.kind] = max(s.longest[f.kind], took)
		}
	}
	if orphaned != nil {
		// kubelet's own race (see orphans): only a kubelet restart clears it.
		s.orphaned = append(s.orphaned, orphaned...)
		s.t.Logf("%s: kubelet %s kept an orphaned registration of %v and rejects every new socket for it; restarting kubelet", strings.Join(what, ", "), kubelet.Version(), orphaned)
		s.e.RestartKubelet()
		s.waitWhole("kubelet restart to clear orphaned registrations")
	}
	// multireg agrees before the next round.
	waitPhases(s.t, s.p, s.cfg, "Registered")
}

// orphans returns the DRA drivers that kubelet 1.36 holds registered although its actual
// state of world forgot their socket, so that it rejects every new socket for them as "already
// registered", forever: multireg backs off and retries in vain.
//
// How kubelet gets there, seen with its own logs at -v 5: the reconciler reads the desired
// state twice per pass, once to unregister and once to register. When a registered socket is
// recreated at the same path between the two reads, the pass registers the new socket without
// unregistering the old one; the DRA handler refuses the same endpoint twice, and on 1.36 a
// failed RegisterPlugin drops the path from the actual state, so the old registration is never
// deregistered. (1.35 keeps the path, unregisters it at the next recreation, and heals.) A pass
// over 200 plugins is long enough to be hit in the soak.
func (s *soak) orphans() []string {
	if !kubelet.RetriesRegisterFailures() {
		return nil
	}
	var out []string
	for _, d := range s.p.Status(s.t).Drivers {
		if d.Phase == "BackingOff" && strings.Contains(d.LastError, "already registered for DRA driver plugin") && s.e.K.Registered(d.Name) {
			out = append(out, d.Name)
		}
	}
	return out
}

// victims picks n distinct configured drivers.
func (s *soak) victims(n int) []driver {
	idx := s.rng.Perm(len(s.cfg))[:n]
	var vs []driver
	for _, i := range idx {
		vs = append(vs, s.cfg[i])
	}
	return vs
}

// inject injects a per-driver fault into v and waits until it has taken effect.
func (s *soak) inject(kind string, v driver) fault {
	t, e := s.t, s.e
	t.Helper()
	regs := e.K.Counts(v.Name).Registrations
	reregistered := func() bool { return e.K.Registered(v.Name) && e.K.Counts(v.Name).Registrations > regs }
	sock := e.Socket(v)
	switch kind {
	case faultEndpoint:
		id := fileid.Of(sock)
		e.StopEndpoint(v)
		waitDriverWithin(t, s.p, v.Name, settleTimeout, "the endpoint seen down", func(d mrproc.DriverStatus) bool { return !d.EndpointUp })
		if !e.K.Registered(v.Name) || fileid.Of(sock) != id {
			t.Errorf("%s: the registration did not stay while the endpoint was down", v.Name)
		}
		healed := reregistered
		if line := keptLine(v.Type); line != "" {
			// A DRA driver, or a CSI driver that answers NodeGetInfo as before: its
			// registration stays — or, for a CSI driver that restarts before multireg could
			// ask it NodeGetInfo after a registration, it is registered again.
			kept := s.p.Count(line, v.Name)
			healed = func() bool { return reregistered() || e.K.Registered(v.Name) && s.p.Count(line, v.Name) > kept }
		}
		return fault{kind: kind, heal: func() { e.StartEndpoint(v) }, healed: healed}
	case faultSocketDeleted:
		if err := os.Remove(sock); err != nil {
			t.Fatal(err)
		}
		return fault{kind: kind, heal: func() {}, healed: reregistered}
	case faultSocketFile:
		content := fmt.Sprintf("decoy for %s, %d", v.Name, s.rng.Int64())
		tmp := filepath.Join(e.Dir, fmt.Sprintf("decoy%d", s.rng.Int64()))
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, sock); err != nil {
			t.Fatal(err)
		}
		id := fileid.Of(sock)
		waitDriverWithin(t, s.p, v.Name, settleTimeout, "the file in the way reported", func(d mrproc.DriverStatus) bool {
			return d.Phase == "BackingOff" && strings.Contains(d.LastError, "is a file, not a socket")
		})
		return fault{kind: kind, heal: func() {
			// multireg never touched it.
			if err := testenv.FileHolds(sock, content); err != nil || fileid.Of(sock) != id {
				t.Errorf("the file in place of %s's socket was touched: %v", v.Name, err)
			}
			if err := os.Remove(sock); err != nil {
				t.Fatal(err)
			}
		}, healed: reregistered}
	case faultRejected:
		n := 1 + s.rng.IntN(2)
		failures := e.K.Counts(v.Name).RegistrationFailures
		e.K.FailRegistrations(v.Name, n)
		if err := os.Remove(sock); err != nil { // a new registration, to reject
			t.Fatal(err)
		}
		wait.For(t, settleTimeout, fmt.Sprintf("kubelet to reject %s %d times", v.Name, n), func() bool {
			return e.K.Counts(v.Name).RegistrationFailures == failures+n
		})
		return fault{kind: kind, heal: func() {}, healed: reregistered}
	}
	t.Fatalf("unknown fault %s", kind)
	return fault{}
}

// kubeletRestart stops kubelet; the heal starts a new one, which must register every driver.
func (s *soak) kubeletRestart() fault {
	s.e.K.Stop()
	return fault{kind: faultKubelet, heal: s.e.StartKubelet, healed: func() bool { return true }}
}

// configEdit adds one to three drivers, removes one to three, and changes one (its backoff
// override toggles), in one write.
func (s *soak) configEdit() fault {
	e := s.e
	var spare []driver
	for _, d := range s.pool {
		if !slices.ContainsFunc(s.cfg, func(c driver) bool { return c.Name == d.Name }) {
			spare = append(spare, d)
		}
	}
	s.rng.Shuffle(len(spare), func(i, j int) { spare[i], spare[j] = spare[j], spare[i] })
	added := spare[:min(len(spare), 1+s.rng.IntN(3))]
	nRemove := min(1+s.rng.IntN(3), len(s.cfg)+len(added)-soakMinDrivers)
	removed := s.victims(max(nRemove, 0))
	kept := testenv.Without(s.cfg, testenv.Names(removed)...)
	changed := kept[s.rng.IntN(len(kept))]
	s.tweaked[changed.Name] = !s.tweaked[changed.Name]
	regs := e.K.Counts(changed.Name).Registrations

	s.cfg = append(kept, added...)
	s.writeConfig()
	return fault{kind: faultConfigEdit, heal: func() {}, healed: func() bool {
		for _, d := range removed {
			if testenv.Exists(e.Socket(d)) {
				return false
			}
		}
		return e.K.Counts(changed.Name).Registrations > regs
	}}
}

// configInvalid breaks the drivers file in one of several ways, checks that the last good
// config stays in force, and heals with the good file.
func (s *soak) configInvalid() fault {
	t, e := s.t, s.e
	good := s.content()
	ways := []struct {
		name      string
		breakFile func()
	}{
		{"invalid yaml", func() { e.WriteConfigContent(good + "drivers: [\n") }},
		{"invalid driver", func() {
			e.WriteConfigContent(good + "  - name: bad.csi.example.com\n    type: CSIPlugin\n    endpoint: csi.sock\n")
		}},
		{"empty", func() { e.WriteConfigContent("") }},
		{"deleted", func() { mustRemove(t, e.Cfg) }},
		{"over 1 MiB", func() { e.WriteConfigContent(good + "#" + strings.Repeat("x", 1<<20) + "\n") }},
		{"symlink loop", func() {
			loop := e.Cfg + ".loop"
			os.Remove(loop)
			if err := os.Symlink(e.Cfg, loop); err != nil {
				t.Fatal(err)
			}
			tmp := e.Cfg + ".link"
			if err := os.Symlink(loop, tmp); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(tmp, e.Cfg); err != nil {
				t.Fatal(err)
			}
		}},
	}
	way := ways[s.rng.IntN(len(ways))]
	way.breakFile()
	wait.Every(t, requestPoll, settleTimeout, "/status to report the "+way.name+" file", func() bool {
		st := s.p.Status(t)
		return !st.Config.LastReloadSuccessful && st.Config.LastReloadError != ""
	})
	if !e.AllRegistered(s.cfg) {
		t.Errorf("a driver lost its registration after an %s file", way.name)
	}
	return fault{kind: faultConfigInvalid, heal: func() {
		if fi, err := os.Lstat(e.Cfg); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			mustRemove(t, e.Cfg)
		}
		s.writeConfig()
	}, healed: func() bool { return s.p.Status(t).Config.LastReloadSuccessful }}
}

// content is the drivers file for the configured drivers.
func (s *soak) content() string {
	ds := slices.Clone(s.cfg)
	for i := range ds {
		if s.tweaked[ds[i].Name] {
			ds[i].Extra = tweakedVersions[ds[i].Type]
		}
	}
	return s.e.ConfigContent(ds)
}

func (s *soak) writeConfig() { s.e.WriteConfigContent(s.content()) }

// tweakedVersions are, by type, versions that differ from the default but for an entry every
// kubelet passes over: kubelet is told them, so the driver is registered again. (An edit of
// loop policy alone, such as backoff, is taken by the running loop and registers nothing.)
var tweakedVersions = map[string]string{
	"CSIPlugin":    "    supportedVersions: [\"1.0.0\", \"0.9.0\"]\n",
	"DRAPlugin":    "    supportedVersions: [\"v1.DRAPlugin\", \"v1beta1.DRAPlugin\", \"v1alpha3.NodeService\"]\n",
	"DevicePlugin": "    supportedVersions: [\"v1beta1\", \"v1alpha\"]\n",
}

// whole reports whether every configured driver is registered in kubelet at its endpoint, and
// no other driver of the pool is.
func (s *soak) whole() bool {
	for _, d := range s.pool {
		in := slices.ContainsFunc(s.cfg, func(c driver) bool { return c.Name == d.Name })
		if s.e.K.Registered(d.Name) != in {
			return false
		}
	}
	return true
}

// waitHealed waits up to limit for the node to be whole and cond (if any) true, fails the test
// if that took longer than -soak-heal, and returns how long it took. It returns early with the
// drivers that kubelet orphaned (see orphans), if any.
func (s *soak) waitHealed(what string, since time.Time, limit time.Duration, cond func() bool) (time.Duration, []string) {
	s.t.Helper()
	ok := func() bool { return s.whole() && (cond == nil || cond()) }
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	lastLook := time.Now()
	for !ok() {
		if time.Since(lastLook) > time.Second {
			lastLook = time.Now()
			if o := s.orphans(); o != nil {
				return time.Since(since), o
			}
		}
		if time.Since(since) > limit {
			var missing, extra []string
			for _, d := range s.pool {
				in := slices.ContainsFunc(s.cfg, func(c driver) bool { return c.Name == d.Name })
				switch reg := s.e.K.Registered(d.Name); {
				case in && !reg:
					missing = append(missing, d.Name)
				case !in && reg:
					extra = append(extra, d.Name)
				}
			}
			s.t.Fatalf("%s: not healed after %v: not registered %v; registered but not configured %v", what, limit, missing, extra)
		}
		<-tick.C
	}
	took := time.Since(since)
	if took > *healDeadline && what != "start" {
		s.t.Errorf("%s: healed after %v, want within %v", what, took.Round(time.Millisecond), *healDeadline)
	}
	return took, nil
}

// waitWhole waits until the node is whole, restarting kubelet if it orphaned registrations.
func (s *soak) waitWhole(what string) {
	s.t.Helper()
	for range 3 {
		_, o := s.waitHealed(what, time.Now(), settleTimeout, nil)
		if o == nil {
			waitPhases(s.t, s.p, s.cfg, "Registered")
			return
		}
		s.orphaned = append(s.orphaned, o...)
		s.e.RestartKubelet()
	}
	s.t.Fatalf("%s: kubelet keeps orphaning registrations", what)
}

// baseline reads the process's resources once it is quiet: the lowest of a few readings.
func (s *soak) baseline(pid int) resources {
	s.t.Helper()
	var base resources
	for i := range 5 {
		if i > 0 {
			time.Sleep(200 * time.Millisecond)
		}
		r := usage(s.t, s.p, pid)
		if i == 0 {
			base = r
			continue
		}
		base = resources{min(base.goroutines, r.goroutines), min(base.fds, r.fds), min(base.watches, r.watches)}
	}
	return base
}

// settle waits until the process's resources are back to base, and returns the last reading.
func (s *soak) settle(pid int, base resources) resources {
	s.t.Helper()
	var r resources
	deadline := time.Now().Add(settleTimeout)
	for {
		r = usage(s.t, s.p, pid)
		if r.goroutines <= base.goroutines+scrapeGoroutines && r.fds <= base.fds && r.watches == base.watches {
			return r
		}
		if time.Now().After(deadline) {
			s.t.Errorf("resources not back to the baseline after %v: %v, baseline %v (goroutines: +%d allowed for the scrape's own)\n%s", settleTimeout, r, base, scrapeGoroutines, goroutineDump(s.t, s.p))
			return r
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// placeForeignFiles puts files that are not multireg's in the registry directory: a
// sentinel, a regular file named like multireg's temporary sockets, a dead socket and a live
// registration socket of another registrar (kubelet registers it).
func (s *soak) placeForeignFiles() {
	t, e := s.t, s.e
	if err := os.MkdirAll(e.Reg, 0o750); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"sentinel": "sentinel of the soak", ".mr-0badf00d.tmp": "a file, not a socket"} {
		p := filepath.Join(e.Reg, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		s.keep[p] = content
	}

	dead := filepath.Join(e.Reg, "dead-foreign.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: dead, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	s.keep[dead] = ""

	foreign := driver{Name: "foreign.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoint(foreign)
	live := filepath.Join(e.Reg, "foreign-reg.sock")
	e.ServeRegistrar(live, foreign.Name, e.EndpointPath(foreign))
	s.keep[live] = ""
	for p := range s.keep {
		s.ids[p] = fileid.Of(p)
	}
	wait.For(t, registerTimeout, "kubelet to register the foreign registrar's driver", func() bool { return e.K.Registered(foreign.Name) })
}

// checkForeignFiles fails the test if a file multireg does not own is gone or changed.
func (s *soak) checkForeignFiles() {
	t := s.t
	for p, content := range s.keep {
		if fileid.Of(p) != s.ids[p] {
			t.Errorf("%s: gone or replaced", p)
			continue
		}
		if content == "" {
			if !testenv.IsSocket(p) {
				t.Errorf("%s: not a socket any more", p)
			}
			continue
		}
		if err := testenv.FileHolds(p, content); err != nil {
			t.Error(err)
		}
	}
	wait.For(t, registerTimeout, "the foreign registrar's driver registered", func() bool { return s.e.K.Registered("foreign.csi.example.com") })
}
