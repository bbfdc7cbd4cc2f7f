package faults

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Faults of the drivers file: deleted, truncated to nothing, cut in the middle of an entry,
// invalid, a symlink loop, over 1 MiB. Each time the last good configuration keeps running
// (no driver moves), /status says config.lastReloadSuccessful=false with the reason, and the
// next valid file (which adds a driver) is applied.
func TestConfigFaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		breakFile func(t *testing.T, e *env, good string)
		reason    string // in /status config.lastReloadError
	}{
		{
			name:      "deleted",
			breakFile: func(t *testing.T, e *env, _ string) { mustRemove(t, e.Cfg) },
			reason:    "no such file or directory",
		},
		{
			name: "truncated",
			breakFile: func(t *testing.T, e *env, _ string) {
				if err := os.Truncate(e.Cfg, 0); err != nil {
					t.Fatal(err)
				}
			},
			reason: "the file is empty",
		},
		{
			name: "cut-mid-entry",
			breakFile: func(t *testing.T, e *env, good string) {
				// Half-written: the file ends in the middle of the last "endpoint" key.
				i := strings.LastIndex(good, "    endpoint: ")
				writeInPlace(t, e.Cfg, good[:i+len("    endp")])
			},
			reason: "yaml: line",
		},
		{
			name: "invalid",
			breakFile: func(t *testing.T, e *env, good string) {
				e.WriteConfigContent(good + "  - name: bad.csi.example.com\n    type: CSIPlugin\n    endpoint: csi.sock\n")
			},
			reason: `endpoint: "csi.sock": must be an absolute path`,
		},
		{
			name: "symlink-loop",
			breakFile: func(t *testing.T, e *env, _ string) {
				loop := filepath.Join(filepath.Dir(e.Cfg), "loop.yaml")
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
			},
			reason: "too many levels of symbolic links",
		},
		{
			name: "over-1MiB",
			breakFile: func(t *testing.T, e *env, good string) {
				pad := strings.Repeat("# padding padding padding padding padding padding padding padding\n", (1<<20)/64+1)
				e.WriteConfigContent(good + pad)
			},
			reason: "larger than 1048576 bytes",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("c", 6)
			added := driver{Name: "added.csi.example.com", Type: "CSIPlugin"}
			e.StartEndpoint(added)
			p := e.startAll(ds)
			good := e.ConfigContent(ds)
			before := e.snap(ds)
			gen := p.Status(t).Config.Generation

			tc.breakFile(t, e, good)
			var st mrproc.Status
			wait.Every(t, requestPoll, registerTimeout, "/status to say the file is not applied, and why", func() bool {
				st = p.Status(t)
				return !st.Config.LastReloadSuccessful && strings.Contains(st.Config.LastReloadError, tc.reason)
			})
			t.Logf("lastReloadError: %s", st.Config.LastReloadError)
			if st.Config.Generation != gen {
				t.Errorf("generation %d → %d for a file that was not applied", gen, st.Config.Generation)
			}
			waitCount(t, p, "config not applied; the last good one stays in force", "", 1)
			if got := mrproc.Metric(p.Metrics(t), "multireg_config_last_reload_successful"); got != 0 {
				t.Errorf("multireg_config_last_reload_successful = %v, want 0", got)
			}
			e.holdUnmoved(before, ds)
			waitCount(t, p, "config not applied; the last good one stays in force", "", 1) // once only
			if n := len(p.Status(t).Drivers); n != len(ds) {
				t.Errorf("%d drivers in /status, want the last good config's %d", n, len(ds))
			}

			// The next valid file applies.
			if fi, err := os.Lstat(e.Cfg); err == nil && fi.Mode()&os.ModeSymlink != 0 {
				mustRemove(t, e.Cfg)
			}
			e.WriteConfig(append(ds, added))
			wait.Every(t, requestPoll, registerTimeout, "the next valid file applied", func() bool {
				st = p.Status(t)
				return st.Config.LastReloadSuccessful && st.Config.LastReloadError == "" && st.Config.Generation == gen+1
			})
			wait.For(t, registerTimeout, "the driver it adds registered", func() bool { return e.K.Registered(added.Name) })
			waitPhases(t, p, []driver{added}, "Registered")
			e.assertUnmoved(before, ds)
		})
	}
}

// Fault: the drivers file is rewritten in place in two writes, as a writer that flushes the
// header first leaves it for a moment: the header without its drivers key, then the rest.
// Read in between, the file is invalid (it does not mean "no drivers"): no driver is ever
// deregistered, /status says why the file was not applied, and the completed file applies
// without moving any driver.
func TestConfigRewrittenInPlaceHeaderFirst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("h", 6)
	p := e.startAll(ds)
	good := e.ConfigContent(ds)
	header, rest, ok := strings.Cut(good, "drivers:\n")
	if !ok {
		t.Fatalf("no drivers key in\n%s", good)
	}
	before := e.snap(ds)
	gen := p.Status(t).Config.Generation

	writeInPlace(t, e.Cfg, header)
	var st mrproc.Status
	wait.Every(t, requestPoll, registerTimeout, "/status to say the header alone is not applied", func() bool {
		st = p.Status(t)
		return !st.Config.LastReloadSuccessful && strings.Contains(st.Config.LastReloadError, "drivers: required")
	})
	t.Logf("lastReloadError: %s", st.Config.LastReloadError)
	e.holdUnmoved(before, ds)

	f, err := os.OpenFile(e.Cfg, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("drivers:\n" + rest); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	wait.Every(t, requestPoll, registerTimeout, "the completed file applied", func() bool {
		st = p.Status(t)
		return st.Config.LastReloadSuccessful && st.Config.Generation == gen+1
	})
	waitCount(t, p, "config reloaded; no driver changed", "", 1)
	e.assertUnmoved(before, ds) // no DeRegister, no new registration, the same sockets
}

// Fault: the drivers file is replaced by a named pipe, which nobody writes. Opening it must
// not block: the running multireg keeps its drivers, says in /status that the file is a named
// pipe, and still exits 0 on SIGTERM. `multireg validate` reads a named pipe as it reads
// -f - (`validate -f <(helm template …)` is one): it judges what its writer sends.
func TestConfigNamedPipe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("n", 6)
	p := e.startAll(ds)
	before := e.snap(ds)

	content, err := os.ReadFile(e.Cfg)
	if err != nil {
		t.Fatal(err)
	}
	fifo := e.Cfg + ".fifo"
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(fifo, e.Cfg); err != nil {
		t.Fatal(err)
	}
	const reason = "is a named pipe (FIFO), not a regular file"
	var st mrproc.Status
	wait.Every(t, requestPoll, registerTimeout, "/status to say the file is a named pipe", func() bool {
		st = p.Status(t)
		return !st.Config.LastReloadSuccessful && strings.Contains(st.Config.LastReloadError, reason)
	})
	t.Logf("lastReloadError: %s", st.Config.LastReloadError)
	e.holdUnmoved(before, ds)

	type result struct {
		out  string
		code int
	}
	done := make(chan result, 1)
	go func() {
		out, code := mrproc.Run(t, "validate", "--config", e.Cfg)
		done <- result{out, code}
	}()
	// The writer: a non-blocking open succeeds once validate has the pipe open for reading.
	var w *os.File
	wait.Every(t, requestPoll, registerTimeout, "multireg validate to open the named pipe", func() bool {
		f, err := os.OpenFile(e.Cfg, os.O_WRONLY|syscall.O_NONBLOCK, 0)
		w = f
		return err == nil
	})
	if _, err := w.Write(content); err != nil {
		t.Fatal(err)
	}
	w.Close()
	select {
	case r := <-done:
		if r.code != 0 {
			t.Errorf("multireg validate on a named pipe given the drivers file: exit %d, output:\n%s\nwant exit 0", r.code, r.out)
		}
	case <-time.After(exitTimeout):
		t.Errorf("multireg validate on a named pipe had not exited %v after its writer closed it", exitTimeout)
		<-done
	}

	p.Signal(t, syscall.SIGTERM)
	if code := p.Wait(t, exitTimeout); code != 0 {
		t.Errorf("exit code %d after SIGTERM, want 0", code)
	}
}

// writeInPlace overwrites the file at path (same inode), as a writer interrupted halfway
// leaves it.
func writeInPlace(t *testing.T, path, content string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func mustRemove(t *testing.T, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
}
