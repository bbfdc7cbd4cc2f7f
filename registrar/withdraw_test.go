package registrar

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// dirLog records, in their order, the creations (a rename into the directory included) and
// removals of the files of a directory.
type dirLog struct {
	mu  sync.Mutex
	evs []string // "create <name>", "remove <name>"
}

// watchDir records what happens to dir's files from now until the test ends.
func watchDir(t *testing.T, dir string) *dirLog {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Add(dir); err != nil {
		t.Fatal(err)
	}
	l := &dirLog{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.Events {
			var what string
			switch {
			case ev.Has(fsnotify.Create):
				what = "create "
			case ev.Has(fsnotify.Remove):
				what = "remove "
			default:
				continue
			}
			l.mu.Lock()
			l.evs = append(l.evs, what+filepath.Base(ev.Name))
			l.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		w.Close()
		<-done
	})
	return l
}

// of returns what happened to the files at paths, in order.
func (l *dirLog) of(paths ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var evs []string
	for _, e := range l.evs {
		_, name, _ := strings.Cut(e, " ")
		if slices.ContainsFunc(paths, func(p string) bool { return filepath.Base(p) == name }) {
			evs = append(evs, e)
		}
	}
	return evs
}

// settleWait is what a DRA driver's loop logs when it waits for kubelet to let go of every
// registration path before it publishes (clearPath).
const settleWait = "waiting until kubelet has let go of a registration path"

// TestDRAWithdrawsFirst: a DRA driver's next registration socket never replaces, nor follows
// at once at its path, a socket kubelet may hold: kubelet's reconciler could register the new
// one before it unregisters the old, and its DRA manager would then keep the old (name,
// endpoint) for good and refuse it ever after. The socket kubelet may hold is removed first;
// the next one is published in a path none was removed from within settling: for a driver
// with one path, there again once kubelet has let go of it; for one with two (an endpoint
// pattern), at once in the other, or once one settled when both were removed. A socket kubelet
// rejected it holds no registration of: the next one follows at once.
func TestDRAWithdrawsFirst(t *testing.T) {
	for _, tt := range []struct {
		name string
		// pattern: the endpoint is a pattern (two registration paths).
		pattern bool
		// stale: the paths where an earlier run's socket is ("primary", "alt"); none: the
		// loop's own registered socket is what kubelet holds.
		stale []string
		// gone: the registered socket is removed by someone else; rejected: kubelet rejects
		// the first socket (it then holds no registration of it); otherwise the driver
		// restarts serving other health services, which kubelet learns only by a new
		// registration (when stale is empty).
		gone, rejected bool
		// wantAt: where the next socket is published; waits: after settleWait.
		wantAt string
		waits  bool
	}{
		{name: "earlier run's socket", stale: []string{"primary"}, wantAt: "primary", waits: true},
		{name: "registered socket removed by someone", gone: true, wantAt: "primary", waits: true},
		{name: "registered socket re-registered", wantAt: "primary", waits: true},
		{name: "socket rejected", rejected: true, wantAt: "primary"},
		{name: "pattern, earlier run's first socket", pattern: true, stale: []string{"primary"}, wantAt: "alt"},
		{name: "pattern, earlier run's second socket", pattern: true, stale: []string{"alt"}, wantAt: "primary"},
		{name: "pattern, earlier run's two sockets", pattern: true, stale: []string{"primary", "alt"}, wantAt: "primary", waits: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var log testkit.Buffer
			dir := testkit.ShortDir(t)
			var d config.Driver
			var e *servedEndpoint
			if tt.pattern {
				d = patternDriver(dir, config.DRAPlugin, "dra-*.sock")
				e = startInstance(t, d, "dra-a.sock")
			} else {
				d = testDriver(dir, "gpu.example.com", config.DRAPlugin, filepath.Join(dir, "ep", "dra.sock"))
				e = testkit.HealthEndpoint(t, d.LocalEndpoint)
			}
			paths := map[string]string{"primary": d.SocketPath, "alt": d.AltSocketPath}
			events := watchDir(t, filepath.Dir(d.SocketPath))
			held := map[string]fsid.ID{}
			for _, name := range tt.stale {
				deadSocket(t, paths[name]) // the earlier run's, served by no one
				held[name] = mustID(t, paths[name])
			}
			s := runSupervisor(t, Options{Log: log.Logger()})
			s.Start(d)
			if len(tt.stale) == 0 {
				awaitSocket(t, d)
				held["primary"] = mustID(t, d.SocketPath)
				if tt.rejected {
					register(t, d.SocketPath, false, "no")
				} else {
					registerAndWait(t, s, d)
				}
				if tt.gone {
					if err := os.Remove(d.SocketPath); err != nil {
						t.Fatal(err)
					}
				} else if !tt.rejected {
					crash(t, s, d, e)
					testkit.HealthEndpoint(t, d.LocalEndpoint, "v1")
				}
			}

			at := paths[tt.wantAt]
			testkit.Eventually(t, 10*time.Second, "the next socket published at "+tt.wantAt, func() bool {
				id, _, err := fsid.Stat(at)
				return err == nil && id != held[tt.wantAt]
			})
			for name := range held {
				if id, _, err := fsid.Stat(paths[name]); name != tt.wantAt && err == nil {
					t.Errorf("the socket kubelet may hold at %s is still there (%v)", name, id)
				}
			}
			// Every socket kubelet may hold went before the next one came.
			var removes []string
			for _, name := range []string{"primary", "alt"} {
				if _, ok := held[name]; ok {
					removes = append(removes, "remove "+filepath.Base(paths[name]))
				}
			}
			created := "create " + filepath.Base(at)
			setupCreates := max(len(tt.stale), 1) // the earlier run's sockets, or the one registered
			var got []string
			testkit.Eventually(t, 5*time.Second, "the events of the driver's paths", func() bool {
				got = events.of(d.SocketPaths()...)
				return len(got) >= setupCreates+len(removes)+1
			})
			got = got[setupCreates:]
			if !slices.Equal(sorted(got[:len(removes)]), sorted(removes)) || got[len(removes)] != created {
				t.Errorf("events at the driver's paths: %q, want %q (in any order), then %q", got, removes, created)
			}
			if waited := strings.Contains(log.String(), settleWait); waited != tt.waits {
				t.Errorf("waited for kubelet to let go of a path: %v, want %v", waited, tt.waits)
			}
			register(t, at, true, "")
			testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
			if st := statusOf(s, d.Name); st.Socket != at {
				t.Errorf("status socket %q, want %q", st.Socket, at)
			}
		})
	}
}

func sorted(s []string) []string { return slices.Sorted(slices.Values(s)) }
