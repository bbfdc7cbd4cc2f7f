package registrar

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

func TestNonSocketInTheWayIsLeftAlone(t *testing.T) {
	for _, kind := range []string{"file", "directory", "symlink"} {
		t.Run(kind, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			ep := filepath.Join(dir, "ep", "csi.sock")
			startEndpoint(t, ep, "nfs.csi.k8s.io")
			d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
			block(t, kind, d.SocketPath)
			other := testDriver(dir, "smb.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep2", "csi.sock"))
			startEndpoint(t, other.LocalEndpoint, other.Name)

			s := runSupervisor(t, Options{})
			s.Start(d)
			s.Start(other)
			testkit.Eventually(t, 5*time.Second, "BackingOff with the reason", func() bool {
				st := statusOf(s, d.Name)
				return st.Phase == BackingOff && strings.Contains(st.LastError, "is a "+kind+", not a socket: it is left untouched")
			})
			// The other driver is not affected.
			testkit.Eventually(t, 5*time.Second, "the other driver's socket", func() bool { return testkit.IsSocket(other.SocketPath) })
			// Still there, unchanged, after several retries.
			testkit.Eventually(t, 5*time.Second, "several retries", func() bool { return statusOf(s, d.Name).Failures >= 3 })
			fi, err := os.Lstat(d.SocketPath)
			if err != nil {
				t.Fatalf("%s in the way: %v", kind, err)
			}
			if kind == "file" {
				if b, _ := os.ReadFile(d.SocketPath); string(b) != "precious" || !fi.Mode().IsRegular() {
					t.Errorf("the file was touched: %q, %v", b, fi.Mode())
				}
			}
			// Once the user removes it, the socket comes.
			if err := os.Remove(d.SocketPath); err != nil {
				t.Fatal(err)
			}
			testkit.Eventually(t, 5*time.Second, "socket after the way is clear", func() bool { return testkit.IsSocket(d.SocketPath) })
		})
	}
}

// TestSocketPublishedOnceTheWayIsClear: while something that is not a socket blocks the
// socket's path, the loop watches the path: its removal publishes the socket at once, not
// when the backoff interval (a minute here) ends. A change that leaves it in the way starts
// no attempt.
func TestSocketPublishedOnceTheWayIsClear(t *testing.T) {
	for _, kind := range []string{"file", "directory", "symlink"} {
		t.Run(kind, func(t *testing.T) {
			s, d, _ := setup(t, config.DevicePlugin, func(d *config.Driver) {
				d.Backoff = config.Backoff{InitialInterval: time.Minute, MaxInterval: time.Minute, Multiplier: 2}
				block(t, kind, d.SocketPath)
			})
			testkit.Eventually(t, 5*time.Second, "BackingOff with the reason", func() bool {
				st := statusOf(s, d.Name)
				return st.Phase == BackingOff && strings.Contains(st.LastError, "is a "+kind+", not a socket")
			})
			if kind != "symlink" { // a symlink's times are its target's
				attempts := statusOf(s, d.Name).Attempts
				if err := os.Chtimes(d.SocketPath, time.Now(), time.Now()); err != nil {
					t.Fatal(err)
				}
				testkit.Never(t, 300*time.Millisecond, "a change of the "+kind+" in the way started an attempt", func() bool {
					return statusOf(s, d.Name).Attempts != attempts
				})
			}
			if err := os.Remove(d.SocketPath); err != nil {
				t.Fatal(err)
			}
			testkit.Eventually(t, 5*time.Second, "socket once the way is clear, long before the backoff ends", func() bool { return testkit.IsSocket(d.SocketPath) })
		})
	}
}

// block puts something that is not a socket at path: a "file", a "directory" or a "symlink".
func block(t *testing.T, kind, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	var err error
	switch kind {
	case "file":
		err = os.WriteFile(path, []byte("precious"), 0o644)
	case "directory":
		err = os.Mkdir(path, 0o755)
	case "symlink":
		err = os.Symlink(filepath.Join(filepath.Dir(path), "nowhere"), path)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// sidecarRegistration is another registrar's Registration service: it answers GetInfo.
type sidecarRegistration struct {
	registerapi.UnimplementedRegistrationServer
}

func (sidecarRegistration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{Type: config.CSIPlugin, Name: "nfs.csi.k8s.io", Endpoint: "/csi.sock", SupportedVersions: []string{"1.0.0"}}, nil
}

// TestServedSocketIsNotReplaced: a socket at the driver's socket path that another process
// serves (a node-driver-registrar sidecar not yet removed: it answers GetInfo) is left alone:
// the driver backs off and says why, and its socket is published as soon as the other one is
// removed, or once no one serves it. A socket whose process accepts but never answers (a
// frozen process: the kernel accepts for it) is not served, and is replaced at once.
func TestServedSocketIsNotReplaced(t *testing.T) {
	for _, how := range []string{"removed", "killed", "frozen"} {
		t.Run(how, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "ep", "csi.sock"))
			startEndpoint(t, d.LocalEndpoint, d.Name)
			if err := os.MkdirAll(filepath.Dir(d.SocketPath), 0o755); err != nil {
				t.Fatal(err)
			}
			l, err := testkit.ListenUnlinked(d.SocketPath) // the file stays when it stops, as SIGKILL leaves it
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			srv := grpc.NewServer()
			registerapi.RegisterRegistrationServer(srv, sidecarRegistration{})
			done := make(chan struct{})
			if how != "frozen" {
				go func() {
					defer close(done)
					srv.Serve(l)
				}()
				t.Cleanup(func() { srv.Stop(); <-done })
			}
			theirs := mustID(t, d.SocketPath)

			var log testkit.Buffer
			s := runSupervisor(t, Options{Log: log.Logger()})
			s.Start(d)
			if how == "frozen" {
				awaitSocket(t, d)
				testkit.Eventually(t, 5*time.Second, "the frozen process's socket replaced", func() bool {
					id, _, err := fsid.Stat(d.SocketPath)
					return err == nil && id != theirs
				})
				registerAndWait(t, s, d)
				return
			}
			testkit.Eventually(t, 5*time.Second, "the reason reported, and the socket held by another", func() bool {
				st := statusOf(s, d.Name)
				return strings.Contains(st.LastError, "is served by another process") && st.HeldByOther
			})
			// Retried every 50-200 ms meanwhile: each retry is BackingOff, held by another, from
			// its start to its end, and the phase changed once.
			testkit.Never(t, 500*time.Millisecond, "the other process's socket replaced, or the status other than BackingOff, held by another", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				st := statusOf(s, d.Name)
				return err != nil || id != theirs || st.Phase != BackingOff || !st.HeldByOther
			})
			if n := strings.Count(log.String(), `msg="phase changed"`); n != 1 {
				t.Errorf("the phase changed %d times, want once (BackingOff)", n)
			}
			if st := statusOf(s, d.Name); st.Phase != BackingOff || st.Ready() {
				t.Errorf("while another process serves the path: %+v, want BackingOff, not ready", st)
			}

			srv.Stop() // the file stays, no one listens: as SIGKILL leaves it
			<-done
			if how == "removed" { // as its SIGTERM leaves it: the socket goes
				if err := os.Remove(d.SocketPath); err != nil {
					t.Fatal(err)
				}
			}
			testkit.Eventually(t, 5*time.Second, "our own socket published", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				return err == nil && id != theirs
			})
			registerAndWait(t, s, d)
			if st := statusOf(s, d.Name); st.HeldByOther {
				t.Errorf("registered through its own socket: %+v, want HeldByOther false", st)
			}
		})
	}
}
