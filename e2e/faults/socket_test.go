package faults

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/kubelet"
)

// Fault: a registration socket is deleted by hand. multireg recreates it at once; kubelet
// deregisters and registers the driver again; no other driver moves.
func TestSocketDeleted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := mixed("x", 6)
	victim := ds[1]
	others := without(ds, victim.name)
	p := e.startAll(ds)
	before := e.snap(others)

	if err := os.Remove(e.socketPath(victim)); err != nil {
		t.Fatal(err)
	}
	kubelet.WaitFor(t, registerTimeout, "a deregistration and a second registration", func() bool {
		c := e.k.Counts(victim.name)
		return c.Deregistrations == 1 && c.Registrations == 2 && e.k.Registered(victim.name)
	})
	waitPhases(t, p, []driver{victim}, "Registered")
	series := fmt.Sprintf(`multireg_socket_recreations_total{driver=%q,reason="socket_removed"}`, victim.name)
	if got := metric(metrics(t, p), series); got != 1 {
		t.Errorf("%s = %v, want 1", series, got)
	}
	e.assertUnmoved(before, others)
	e.holdUnmoved(before, others)
}

// Fault: something that is not a socket takes the place of a registration socket: a regular
// file or a dangling symlink renamed over it, or a directory (with a file in it) made where
// it was. multireg never touches it, keeps its driver in BackingOff and says why in /status;
// once the thing is removed, the driver registers again, at once: its backoff interval is a
// minute, longer than the test waits. No other driver moves.
func TestSocketReplaced(t *testing.T) {
	t.Parallel()
	const content = "not multireg's"
	for _, tc := range []struct {
		kind  string
		place func(t *testing.T, e *env, path string) // puts the thing at path, in place of the socket
		check func(path string) error                 // the thing is intact
	}{
		{
			kind: "file",
			place: func(t *testing.T, e *env, path string) {
				tmp := filepath.Join(e.dir, "decoy")
				if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(tmp, path); err != nil {
					t.Fatal(err)
				}
			},
			check: func(path string) error { return fileHolds(path, content) },
		},
		{
			kind: "symlink",
			place: func(t *testing.T, e *env, path string) {
				tmp := filepath.Join(e.dir, "decoy")
				if err := os.Symlink(filepath.Join(e.dir, "nowhere"), tmp); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(tmp, path); err != nil {
					t.Fatal(err)
				}
			},
			check: func(path string) error {
				target, err := os.Readlink(path)
				if err == nil && filepath.Base(target) != "nowhere" {
					err = fmt.Errorf("symlink to %s", target)
				}
				return err
			},
		},
		{
			kind: "directory",
			place: func(t *testing.T, e *env, path string) {
				// A directory cannot be renamed over a socket: remove the socket and make the
				// directory, again if multireg recreated its socket in between.
				for i := 0; ; i++ {
					if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
						t.Fatal(err)
					}
					err := os.Mkdir(path, 0o755)
					if err == nil {
						break
					}
					if !os.IsExist(err) || i == 100 {
						t.Fatal(err)
					}
				}
				if err := os.WriteFile(filepath.Join(path, "keep"), []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			},
			check: func(path string) error { return fileHolds(filepath.Join(path, "keep"), content) },
		},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := mixed("p", 6)
			ds[2].extra = "    backoff: {initialInterval: 1m, maxInterval: 1m}\n"
			victim := ds[2]
			others := without(ds, victim.name)
			p := e.startAll(ds)
			before := e.snap(others)
			regs := e.k.Counts(victim.name).Registrations
			path := e.socketPath(victim)

			tc.place(t, e, path)
			placed := idOf(path)
			want := fmt.Sprintf("%s is a %s, not a socket", path, tc.kind)
			d := waitDriver(t, p, victim.name, "/status to report the "+tc.kind, func(d driverStatus) bool {
				return d.Phase == "BackingOff" && strings.Contains(d.LastError, want)
			})
			t.Logf("lastError: %s", d.LastError)
			kubelet.Never(t, quietPeriod, "the "+tc.kind+" in the way was touched", func() bool {
				return idOf(path) != placed || tc.check(path) != nil
			})
			e.assertUnmoved(before, others)

			if err := os.RemoveAll(path); err != nil {
				t.Fatal(err)
			}
			kubelet.WaitFor(t, registerTimeout, "the driver registered again once the "+tc.kind+" is gone", func() bool {
				return e.k.Registered(victim.name) && e.k.Counts(victim.name).Registrations == regs+1 && isSocket(path)
			})
			waitPhases(t, p, []driver{victim}, "Registered")
			e.assertUnmoved(before, others)
		})
	}
}

// Fault: the registry directory is deleted (with every socket, the lock file, and a file of
// someone else's) and created again. multireg publishes every socket in the new directory and
// takes its lock again. kubelet's watch died with the old directory, as a real kubelet's does,
// so the kubelet restarts; it registers every driver on multireg's new sockets. multireg is
// the same process throughout.
func TestRegistryDirRecreated(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := mixed("g", 9)
	p := e.startAll(ds)
	pid := pidOf(t, e.cfg)
	old := e.snap(ds).ids

	e.recreateRegistry()
	kubelet.WaitFor(t, registerTimeout, "kubelet to deregister every driver", func() bool { return len(e.k.RegisteredNames()) == 0 })
	kubelet.WaitFor(t, registerTimeout, "every socket published in the new directory", func() bool {
		for _, d := range ds {
			if !isSocket(e.socketPath(d)) || idOf(e.socketPath(d)) == old[d.name] {
				return false
			}
		}
		return true
	})
	lock := filepath.Join(e.reg, ".multireg.lock")
	kubelet.WaitFor(t, registerTimeout, "multireg to take the new directory's lock", func() bool { return isExisting(lock) })

	e.restartKubelet()
	e.waitRegistered(p, ds)
	for _, d := range ds {
		if c := e.k.Counts(d.name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want one registration", d.name, c)
		}
	}
	if got := pidOf(t, e.cfg); got != pid {
		t.Errorf("multireg pid %d → %d", pid, got)
	}
	if !healthy(t, p) {
		t.Error("/healthz not 200")
	}
}

// fileHolds fails unless the regular file at path holds content.
func fileHolds(path, content string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is %v, not a regular file", path, fi.Mode().Type())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if string(b) != content {
		return fmt.Errorf("%s holds %q, want %q", path, b, content)
	}
	return nil
}
