package faults

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/kubelet"
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
			breakFile: func(t *testing.T, e *env, _ string) { mustRemove(t, e.cfg) },
			reason:    "no such file or directory",
		},
		{
			name: "truncated",
			breakFile: func(t *testing.T, e *env, _ string) {
				if err := os.Truncate(e.cfg, 0); err != nil {
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
				writeInPlace(t, e.cfg, good[:i+len("    endp")])
			},
			reason: "yaml: line",
		},
		{
			name: "invalid",
			breakFile: func(t *testing.T, e *env, good string) {
				e.writeConfigContent(good + "  - name: bad.csi.example.com\n    type: CSIPlugin\n    endpoint: csi.sock\n")
			},
			reason: `endpoint: "csi.sock": must be an absolute path`,
		},
		{
			name: "symlink-loop",
			breakFile: func(t *testing.T, e *env, _ string) {
				loop := filepath.Join(filepath.Dir(e.cfg), "loop.yaml")
				if err := os.Symlink(e.cfg, loop); err != nil {
					t.Fatal(err)
				}
				tmp := e.cfg + ".link"
				if err := os.Symlink(loop, tmp); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(tmp, e.cfg); err != nil {
					t.Fatal(err)
				}
			},
			reason: "too many levels of symbolic links",
		},
		{
			name: "over-1MiB",
			breakFile: func(t *testing.T, e *env, good string) {
				pad := strings.Repeat("# padding padding padding padding padding padding padding padding\n", (1<<20)/64+1)
				e.writeConfigContent(good + pad)
			},
			reason: "larger than 1048576 bytes",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := mixed("c", 6)
			added := driver{name: "added.csi.example.com", typ: "CSIPlugin"}
			e.startEndpoint(added)
			p := e.startAll(ds)
			good := e.configContent(ds)
			before := e.snap(ds)
			gen := status(t, p).Config.Generation

			tc.breakFile(t, e, good)
			var st statusDoc
			poll(t, registerTimeout, "/status to say the file is not applied, and why", func() bool {
				st = status(t, p)
				return !st.Config.LastReloadSuccessful && strings.Contains(st.Config.LastReloadError, tc.reason)
			})
			t.Logf("lastReloadError: %s", st.Config.LastReloadError)
			if st.Config.Generation != gen {
				t.Errorf("generation %d → %d for a file that was not applied", gen, st.Config.Generation)
			}
			waitCount(t, p, "config not applied; the last good one stays in force", "", 1)
			if got := metric(metrics(t, p), "multireg_config_last_reload_successful"); got != 0 {
				t.Errorf("multireg_config_last_reload_successful = %v, want 0", got)
			}
			e.holdUnmoved(before, ds)
			waitCount(t, p, "config not applied; the last good one stays in force", "", 1) // once only
			if n := len(status(t, p).Drivers); n != len(ds) {
				t.Errorf("%d drivers in /status, want the last good config's %d", n, len(ds))
			}

			// The next valid file applies.
			if fi, err := os.Lstat(e.cfg); err == nil && fi.Mode()&os.ModeSymlink != 0 {
				mustRemove(t, e.cfg)
			}
			e.writeConfig(append(ds, added))
			poll(t, registerTimeout, "the next valid file applied", func() bool {
				st = status(t, p)
				return st.Config.LastReloadSuccessful && st.Config.LastReloadError == "" && st.Config.Generation == gen+1
			})
			kubelet.WaitFor(t, registerTimeout, "the driver it adds registered", func() bool { return e.k.Registered(added.name) })
			waitPhases(t, p, []driver{added}, "Registered")
			e.assertUnmoved(before, ds)
		})
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
