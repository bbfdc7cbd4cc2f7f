package registrar

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// throughLink is d reaching its endpoint through a symbolic link to the endpoint's directory,
// at dir/via: the same socket, by another path (config.Local).
func throughLink(t *testing.T, d config.Driver, via string) config.Driver {
	t.Helper()
	if err := os.Symlink(filepath.Dir(d.LocalEndpoint), via); err != nil && !os.IsExist(err) {
		t.Fatal(err)
	}
	d.LocalEndpoint = filepath.Join(via, filepath.Base(d.LocalEndpoint))
	return d
}

// TestHandOverWithAnotherLocalEndpointKeepsEverySocket: the new instance reaches each
// driver's endpoint by another path (localEndpoint), which kubelet never sees: every socket
// is taken over and kept, and no driver is registered again.
func TestHandOverWithAnotherLocalEndpointKeepsEverySocket(t *testing.T) {
	reg, ds, a, before := registeredMultireg(t)
	via := filepath.Join(filepath.Dir(reg), "via")
	edited := slices.Clone(ds)
	for i := range edited {
		edited[i] = throughLink(t, edited[i], via)
	}
	b := startMultireg(t, reg, edited)
	a.handedOver(t)
	if n := b.sup.TakenOver(); n != len(ds) {
		t.Errorf("%d sockets taken over, want %d", n, len(ds))
	}
	for _, d := range edited {
		testkit.Eventually(t, 5*time.Second, d.Name+" Registered in the new instance", func() bool { return statusOf(b.sup, d.Name).Phase == Registered })
	}
	// The loops have decided on their sockets: each probed its endpoint once, and kept it.
	for _, d := range edited {
		testkit.Eventually(t, 5*time.Second, d.Name+"'s endpoint probed", func() bool { return statusOf(b.sup, d.Name).EndpointUp })
		if st := statusOf(b.sup, d.Name); st.Attempts != 1 || st.EndpointRestarts != 0 || len(st.Recreations) != 0 {
			t.Errorf("%s: %+v, want the first instance's one attempt, nothing recreated", d.Name, st)
		}
	}
	if now := ids(t, ds); !slices.Equal(now, before) {
		t.Errorf("sockets replaced: %v, were %v", now, before)
	}
}

// TestReloadOfLocalEndpointKeepsTheSocket: a drivers-file edit of where multireg reaches the
// endpoint (localEndpoint) alone is an update (config.Local): the loop goes on there with its
// socket, kubelet sees nothing, and the endpoint is watched where the file now says.
func TestReloadOfLocalEndpointKeepsTheSocket(t *testing.T) {
	for _, typ := range config.Types {
		t.Run(typ, func(t *testing.T) {
			t.Parallel()
			var log testkit.Buffer
			dir := testkit.ShortDir(t)
			n := fixtureDrivers[typ]
			d := testDriver(dir, n.name, typ, filepath.Join(dir, "ep", n.socket))
			csiName := ""
			if typ == config.CSIPlugin {
				csiName = d.Name
			}
			startEndpoint(t, d.LocalEndpoint, csiName)
			// A second name of the endpoint's socket (a hard link reaches the same listening
			// socket), in a directory of its own, made before the socket is probed: a link
			// changes the socket's change time, part of its identity.
			edited := d
			edited.LocalEndpoint = filepath.Join(dir, "ep2", n.socket)
			if err := os.Mkdir(filepath.Dir(edited.LocalEndpoint), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Link(d.LocalEndpoint, edited.LocalEndpoint); err != nil {
				t.Fatal(err)
			}
			s := runSupervisor(t, Options{Log: log.Logger()})
			s.Start(d)
			awaitSocket(t, d)
			registerAndWait(t, s, d)
			before := mustID(t, d.SocketPath)
			if p := config.Diff(&config.RegistrarConfig{Drivers: []config.Driver{d}}, &config.RegistrarConfig{Drivers: []config.Driver{edited}}); len(p.Updated) != 1 {
				t.Fatalf("the edit is %+v, want an update", p)
			}
			s.Update(edited)
			t.Cleanup(func() {
				if t.Failed() {
					t.Log(log.String())
				}
			})
			awaitTransition(t, &log, "TakingOver_EndpointUp_Registered")
			if st := statusOf(s, d.Name); st.Attempts != 1 || st.EndpointRestarts != 0 || len(st.Recreations) != 0 {
				t.Errorf("status %+v, want one attempt, nothing recreated", st)
			}
			if now := mustID(t, d.SocketPath); now != before {
				t.Errorf("the socket was replaced: %v, was %v", now, before)
			}
			// The endpoint is watched by its second name now: removing that name takes it away
			// from the loop, while the first stays.
			if err := os.Remove(edited.LocalEndpoint); err != nil {
				t.Fatal(err)
			}
			testkit.Eventually(t, 5*time.Second, "the endpoint down where the edit says", func() bool { return !statusOf(s, d.Name).EndpointUp })
			if st := statusOf(s, d.Name); st.Phase != Registered || mustID(t, d.SocketPath) != before {
				t.Errorf("after the endpoint went: %+v, the socket %v; want the registration kept", st, mustID(t, d.SocketPath))
			}
		})
	}
}
