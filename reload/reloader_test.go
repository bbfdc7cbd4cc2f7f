package reload

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// recorder is an applier that records the calls in order.
type recorder struct {
	mu    sync.Mutex
	calls []string
}

func (r *recorder) Start(d config.Driver) { r.add("start " + d.Name + " " + d.Endpoint) }
func (r *recorder) Stop(name string)      { r.add("stop " + name) }
func (r *recorder) Update(d config.Driver) {
	r.add(fmt.Sprintf("update %s required=%v", d.Name, d.Required))
}

func (r *recorder) add(c string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, c)
}

// take returns the calls since the last take.
func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

func drivers(eps ...string) string {
	var b strings.Builder
	b.WriteString("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\ndrivers:\n")
	for i, ep := range eps {
		fmt.Fprintf(&b, "  - {name: d%d.csi.example.com, type: CSIPlugin, endpoint: %s}\n", i, ep)
	}
	return b.String()
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// started is a Reloader running in the test's synctest bubble (or not), with its file.
type started struct {
	r    *Reloader
	rec  *recorder
	path string
	logs *testkit.Buffer
	stop func()
}

func start(t *testing.T, content string, opts Options) *started {
	t.Helper()
	path := filepath.Join(t.TempDir(), "drivers.yaml")
	write(t, path, content)
	return startAt(t, path, opts)
}

// startAt runs a Reloader on the file at path.
func startAt(t *testing.T, path string, opts Options) *started {
	t.Helper()
	cfg, b, err := config.LoadContent(path)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	logs := &testkit.Buffer{}
	opts.Path, opts.Initial, opts.InitialContent, opts.Apply = path, cfg, b, rec
	opts.Log = slog.New(slog.NewTextHandler(logs, nil))
	r := New(opts)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return &started{r: r, rec: rec, path: path, logs: logs, stop: func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}}
}

func TestInitialConfigStarts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock", "/run/b.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		want := []string{"start d0.csi.example.com /run/a.sock", "start d1.csi.example.com /run/b.sock"}
		if got := s.rec.take(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("calls %q, want %q", got, want)
		}
		if st := s.r.State(); st.Generation != 1 || !st.LastReloadSuccessful || st.Path != s.path {
			t.Errorf("state %+v", st)
		}
	})
}

// TestRequiredChangeIsAnUpdate: a driver whose only change is required is updated in place,
// neither stopped nor started: its registration is not touched.
func TestRequiredChangeIsAnUpdate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock", "/run/b.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()

		write(t, s.path, drivers("/run/a.sock", "/run/b.sock")+"defaults: {required: true}\n")
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		want := []string{"update d0.csi.example.com required=true", "update d1.csi.example.com required=true"}
		if got := s.rec.take(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("calls %q, want %q", got, want)
		}
		if st := s.r.State(); st.Generation != 2 {
			t.Errorf("generation %d, want 2", st.Generation)
		}
	})
}

// TestDebounce: a burst of kicks is read once, 100 ms after the last one.
func TestDebounce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()

		write(t, s.path, drivers("/run/a2.sock"))
		begin := time.Now()
		for range 3 {
			s.r.Kick()
			time.Sleep(40 * time.Millisecond)
		}
		// 120 ms after the first kick, 40 ms after the last: nothing yet.
		synctest.Wait()
		if got := s.rec.take(); len(got) != 0 {
			t.Fatalf("applied during the burst: %q", got)
		}
		time.Sleep(60 * time.Millisecond)
		synctest.Wait()
		want := []string{"stop d0.csi.example.com", "start d0.csi.example.com /run/a2.sock"}
		if got := s.rec.take(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("after %s: calls %q, want %q", time.Since(begin), got, want)
		}
		if st := s.r.State(); st.Generation != 2 {
			t.Errorf("generation %d, want 2", st.Generation)
		}
	})
}

// TestDebounceIsBounded: a steady stream of events cannot hold a change back for more than
// a second.
func TestDebounceIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		write(t, s.path, drivers("/run/a2.sock"))
		begin := time.Now()
		for time.Since(begin) < 3*time.Second {
			s.r.Kick()
			time.Sleep(50 * time.Millisecond)
			synctest.Wait()
			if len(s.rec.take()) > 0 {
				if d := time.Since(begin); d > time.Second+100*time.Millisecond {
					t.Errorf("applied %s after the first event, want at most 1.1s", d)
				}
				return
			}
		}
		t.Error("never applied under a steady stream of events")
	})
}

// TestResync: without any event, the file is re-read every minute.
func TestResync(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		write(t, s.path, drivers("/run/a.sock", "/run/b.sock"))
		time.Sleep(59 * time.Second)
		synctest.Wait()
		if got := s.rec.take(); len(got) != 0 {
			t.Fatalf("applied before the resync: %q", got)
		}
		time.Sleep(time.Second + DefaultDebounce)
		synctest.Wait()
		if got, want := s.rec.take(), []string{"start d1.csi.example.com /run/b.sock"}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("calls %q, want %q", got, want)
		}
	})
}

// TestUnchangedContentDoesNothing: kubelet touches mounted ConfigMaps every minute; the same
// content must cause no call and no info line, however often it is read.
func TestUnchangedContentDoesNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		for range 50 {
			write(t, s.path, drivers("/run/a.sock")) // a touch: same bytes, new mtime
			s.r.Kick()
			time.Sleep(200 * time.Millisecond)
		}
		time.Sleep(5 * time.Minute) // resyncs too
		synctest.Wait()
		if got := s.rec.take(); len(got) != 0 {
			t.Errorf("calls for unchanged content: %q", got)
		}
		if s.logs.Len() != 0 {
			t.Errorf("log lines for unchanged content:\n%s", s.logs)
		}
		if st := s.r.State(); st.Generation != 1 || !st.LastReloadSuccessful {
			t.Errorf("state %+v", st)
		}
	})
}

// TestBadFileKeepsLastGood: invalid, empty, half-written and missing files change nothing;
// each is reported once; the first valid file afterwards is applied.
func TestBadFileKeepsLastGood(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := start(t, drivers("/run/a.sock", "/run/b.sock"), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		good := drivers("/run/a.sock", "/run/b.sock")
		bad := []struct{ name, content string }{
			{"invalid YAML", "drivers: [\n"},
			{"an invalid driver", drivers("/run/a.sock", "relative.sock")},
			{"empty", ""},
			{"half-written", good[:len(good)/2]},
			{"missing", ""},
		}
		for _, b := range bad {
			if b.name == "missing" {
				if err := os.Remove(s.path); err != nil {
					t.Fatal(err)
				}
			} else {
				write(t, s.path, b.content)
			}
			for range 3 { // read three times, reported once
				s.r.Kick()
				time.Sleep(time.Second)
			}
			synctest.Wait()
			if got := s.rec.take(); len(got) != 0 {
				t.Errorf("%s: calls %q, want none", b.name, got)
			}
			st := s.r.State()
			if st.LastReloadSuccessful || st.LastReloadError == "" || st.Generation != 1 {
				t.Errorf("%s: state %+v, want the failure recorded", b.name, st)
			}
		}
		if n := strings.Count(s.logs.String(), "config not applied"); n != len(bad) {
			t.Errorf("%d warnings for %d bad files, want one each:\n%s", n, len(bad), s.logs)
		}
		write(t, s.path, drivers("/run/a.sock", "/run/b2.sock"))
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		if got, want := s.rec.take(), []string{"stop d1.csi.example.com", "start d1.csi.example.com /run/b2.sock"}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("after the fix: calls %q, want %q", got, want)
		}
		if st := s.r.State(); !st.LastReloadSuccessful || st.LastReloadError != "" || st.Generation != 2 {
			t.Errorf("after the fix: state %+v", st)
		}
	})
}

// TestReloadLooksThroughLinks: a reload parses as multireg run does at start: a device plugin
// whose endpoint's directory is, through a symlink, the device-plugins directory under
// registrationDir's root is refused, and the last good file stays.
func TestReloadLooksThroughLinks(t *testing.T) {
	top := testkit.ShortDir(t)
	root := filepath.Join(top, "root")
	for _, d := range []string{"plugins_registry", "device-plugins", "plugins/x"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(top, "link")
	if err := os.Symlink(filepath.Join(root, "device-plugins"), link); err != nil {
		t.Fatal(err)
	}
	file := func(dir string) string {
		return "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: " + filepath.Join(root, "plugins_registry") +
			"\ndrivers:\n  - {name: example.com/x, type: DevicePlugin, endpoint: " + filepath.Join(dir, "x.sock") + "}\n"
	}
	synctest.Test(t, func(t *testing.T) {
		s := start(t, file(filepath.Join(root, "plugins", "x")), Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		write(t, s.path, file(link))
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		if got := s.rec.take(); len(got) != 0 {
			t.Errorf("calls %q, want none", got)
		}
		want := `drivers[0].endpoint: "` + link + `/x.sock": is in ` + link + `, the same directory here as ` + filepath.Join(root, "device-plugins")
		if st := s.r.State(); st.LastReloadSuccessful || !strings.Contains(st.LastReloadError, want) || st.Generation != 1 {
			t.Errorf("state %+v, want the failure recorded: %s", st, want)
		}
	})
}

// TestStopBeforeStart: every stop of an edit comes before its first start, so a socket path
// can move from one driver to another.
func TestStopBeforeStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		initial := `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
drivers:
  - {name: old.csi.example.com, type: CSIPlugin, endpoint: /run/old.sock, socketName: shared.sock}
  - {name: keep.csi.example.com, type: CSIPlugin, endpoint: /run/keep.sock}
  - {name: edit.csi.example.com, type: CSIPlugin, endpoint: /run/edit.sock}
`
		s := start(t, initial, Options{NoWatch: true})
		defer s.stop()
		synctest.Wait()
		s.rec.take()
		write(t, s.path, `apiVersion: multireg.dev/v1alpha1
kind: RegistrarConfig
drivers:
  - {name: new.csi.example.com, type: CSIPlugin, endpoint: /run/new.sock, socketName: shared.sock}
  - {name: keep.csi.example.com, type: CSIPlugin, endpoint: /run/keep.sock}
  - {name: edit.csi.example.com, type: CSIPlugin, endpoint: /run/edit2.sock}
`)
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		want := []string{
			"stop old.csi.example.com",
			"stop edit.csi.example.com",
			"start new.csi.example.com /run/new.sock",
			"start edit.csi.example.com /run/edit2.sock",
		}
		if got := s.rec.take(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("calls %q, want %q", got, want)
		}
		if !strings.Contains(s.logs.String(), `added=[new.csi.example.com] removed=[old.csi.example.com] changed=[edit.csi.example.com]`) {
			t.Errorf("log does not say what changed:\n%s", s.logs)
		}
	})
}

// TestRegistrationDirMove: moving the registration directory asks MoveDir first; a refusal
// keeps the last good configuration, an acceptance is completed after the apply.
func TestRegistrationDirMove(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var refuse bool
		var moves []string
		opts := Options{NoWatch: true, MoveDir: func(dir string) (func(), error) {
			if refuse {
				return nil, fmt.Errorf("another multireg holds %s/.multireg.lock", dir)
			}
			moves = append(moves, "check "+dir)
			return func() { moves = append(moves, "done "+dir) }, nil
		}}
		s := start(t, drivers("/run/a.sock"), opts)
		defer s.stop()
		synctest.Wait()
		s.rec.take()

		refuse = true
		write(t, s.path, strings.Replace(drivers("/run/a.sock"), "drivers:\n", "registrationDir: /var/lib/k0s/kubelet/plugins_registry\ndrivers:\n", 1))
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		if got := s.rec.take(); len(got) != 0 {
			t.Errorf("applied a refused move: %q", got)
		}
		if st := s.r.State(); st.LastReloadSuccessful || !strings.Contains(st.LastReloadError, "another multireg holds") {
			t.Errorf("state %+v", st)
		}

		refuse = false
		write(t, s.path, strings.Replace(drivers("/run/a.sock"), "drivers:\n", "registrationDir: /var/lib/k3s/plugins_registry\ndrivers:\n", 1))
		s.r.Kick()
		time.Sleep(time.Second)
		synctest.Wait()
		if got := s.rec.take(); len(got) != 2 {
			t.Errorf("calls %q, want the driver restarted in the new directory", got)
		}
		if want := []string{"check /var/lib/k3s/plugins_registry", "done /var/lib/k3s/plugins_registry"}; fmt.Sprint(moves) != fmt.Sprint(want) {
			t.Errorf("moves %q, want %q", moves, want)
		}
	})
}

// TestRefusedMoveIsRetried: a move of the registration directory that MoveDir refuses is not
// applied, and the same content is tried again at every later read (a kick, or the resync),
// until MoveDir accepts it. Each reason is logged once, however often it is tried.
func TestRefusedMoveIsRetried(t *testing.T) {
	triggers := map[string]func(*Reloader){
		"kick":   func(r *Reloader) { r.Kick(); time.Sleep(time.Second) },
		"resync": func(*Reloader) { time.Sleep(DefaultResync) },
	}
	for name, trigger := range triggers {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				// Shared with Run's goroutine: the resync wakes it with no synchronization.
				var tries atomic.Int32
				var refusal atomic.Value
				refusal.Store("another multireg holds %s/.multireg.lock")
				opts := Options{NoWatch: true, MoveDir: func(dir string) (func(), error) {
					tries.Add(1)
					if r := refusal.Load().(string); r != "" {
						return nil, fmt.Errorf(r, dir)
					}
					return func() {}, nil
				}}
				s := start(t, drivers("/run/a.sock"), opts)
				defer s.stop()
				synctest.Wait()
				s.rec.take()

				time.Sleep(time.Second) // off the resync's beat: each trigger ends after its read
				write(t, s.path, strings.Replace(drivers("/run/a.sock"), "drivers:\n", "registrationDir: /var/lib/k0s/kubelet/plugins_registry\ndrivers:\n", 1))
				warned := func(want int) {
					t.Helper()
					synctest.Wait()
					if got := s.rec.take(); len(got) != 0 {
						t.Errorf("applied a refused move: %q", got)
					}
					if st := s.r.State(); st.LastReloadSuccessful || !strings.Contains(st.LastReloadError, "another multireg") || st.Generation != 1 {
						t.Errorf("state %+v, want the refusal recorded", st)
					}
					if n := strings.Count(s.logs.String(), "config not applied"); n != want {
						t.Errorf("%d warnings, want %d:\n%s", n, want, s.logs)
					}
				}
				for range 3 {
					trigger(s.r)
				}
				warned(1)
				if n := tries.Load(); n != 3 {
					t.Errorf("MoveDir tried %d times, want 3", n)
				}
				refusal.Store("another multireg still holds %s/.multireg.lock")
				for range 2 {
					trigger(s.r)
				}
				warned(2)

				refusal.Store("")
				trigger(s.r)
				synctest.Wait()
				if got := s.rec.take(); len(got) != 2 {
					t.Errorf("calls %q, want the driver restarted in the new directory", got)
				}
				if st := s.r.State(); !st.LastReloadSuccessful || st.LastReloadError != "" || st.Generation != 2 {
					t.Errorf("state %+v, want the move applied", st)
				}
				trigger(s.r)
				synctest.Wait()
				if n := tries.Load(); n != 6 {
					t.Errorf("MoveDir tried %d times, want 6: once applied, the content is judged", n)
				}
			})
		})
	}
}
