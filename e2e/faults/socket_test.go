package faults

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: a registration socket is deleted by hand. multireg recreates it at once; kubelet
// deregisters and registers the driver again; no other driver moves.
func TestSocketDeleted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("x", 6)
	victim := ds[1]
	others := testenv.Without(ds, victim.Name)
	p := e.startAll(ds)
	before := e.snap(others)

	if err := os.Remove(e.SocketPath(victim)); err != nil {
		t.Fatal(err)
	}
	wait.For(t, registerTimeout, "a deregistration and a second registration", func() bool {
		c := e.K.Counts(victim.Name)
		return c.Deregistrations == 1 && c.Registrations == 2 && e.K.Registered(victim.Name)
	})
	waitPhases(t, p, []driver{victim}, "Registered")
	series := fmt.Sprintf(`multireg_socket_recreations_total{driver=%q,reason="socket_removed"}`, victim.Name)
	if got := mrproc.Metric(p.Metrics(t), series); got != 1 {
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
				tmp := filepath.Join(e.Dir, "decoy")
				if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(tmp, path); err != nil {
					t.Fatal(err)
				}
			},
			check: func(path string) error { return testenv.FileHolds(path, content) },
		},
		{
			kind: "symlink",
			place: func(t *testing.T, e *env, path string) {
				tmp := filepath.Join(e.Dir, "decoy")
				if err := os.Symlink(filepath.Join(e.Dir, "nowhere"), tmp); err != nil {
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
			check: func(path string) error { return testenv.FileHolds(filepath.Join(path, "keep"), content) },
		},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("p", 6)
			ds[2].Extra = "    backoff: {initialInterval: 1m, maxInterval: 1m}\n"
			victim := ds[2]
			others := testenv.Without(ds, victim.Name)
			p := e.startAll(ds)
			before := e.snap(others)
			regs := e.K.Counts(victim.Name).Registrations
			path := e.SocketPath(victim)

			tc.place(t, e, path)
			placed := fileid.Of(path)
			want := fmt.Sprintf("%s is a %s, not a socket", path, tc.kind)
			d := waitDriver(t, p, victim.Name, "/status to report the "+tc.kind, func(d mrproc.DriverStatus) bool {
				return d.Phase == "BackingOff" && strings.Contains(d.LastError, want)
			})
			t.Logf("lastError: %s", d.LastError)
			wait.Never(t, quietPeriod, "the "+tc.kind+" in the way was touched", func() bool {
				return fileid.Of(path) != placed || tc.check(path) != nil
			})
			e.assertUnmoved(before, others)

			if err := os.RemoveAll(path); err != nil {
				t.Fatal(err)
			}
			wait.For(t, registerTimeout, "the driver registered again once the "+tc.kind+" is gone", func() bool {
				return e.K.Registered(victim.Name) && e.K.Counts(victim.Name).Registrations == regs+1 && testenv.IsSocket(path)
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
	ds := testenv.Mixed("g", 9)
	p := e.startAll(ds)
	pid := pidOf(t, e.Cfg)
	old := e.snap(ds).ids

	e.RecreateRegistry()
	wait.For(t, registerTimeout, "kubelet to deregister every driver", func() bool { return len(e.K.RegisteredNames()) == 0 })
	wait.For(t, registerTimeout, "every socket published in the new directory", func() bool {
		for _, d := range ds {
			if !testenv.IsSocket(e.Socket(d)) || fileid.Of(e.Socket(d)) == old[d.Name] {
				return false
			}
		}
		return true
	})
	lock := filepath.Join(e.Reg, ".multireg.lock")
	wait.For(t, registerTimeout, "multireg to take the new directory's lock", func() bool { return testenv.Exists(lock) })

	e.RestartKubelet()
	e.waitRegistered(p, ds)
	for _, d := range ds {
		if c := e.K.Counts(d.Name); c.Registrations != 1 || c.RegistrationFailures != 0 {
			t.Errorf("%s: %+v, want one registration", d.Name, c)
		}
	}
	if got := pidOf(t, e.Cfg); got != pid {
		t.Errorf("multireg pid %d → %d", pid, got)
	}
	if !p.Healthy(t) {
		t.Error("/healthz not 200")
	}
}
