package faults

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: a driver's endpoint dies (its socket removed, as a crashing driver leaves it) and
// comes back. While it is down the registration stays — same socket, no deregistration —
// and /status shows the endpoint down; when it returns a device plugin is registered again
// once, a DRA driver keeps its registration (kubelet reconnects to it by itself), and so does
// a CSI driver that answers NodeGetInfo as before (TestCSIEndpointRestart has both cases).
func TestEndpointDiesAndReturns(t *testing.T) {
	t.Parallel()
	for i, typ := range []string{"CSIPlugin", "DRAPlugin", "DevicePlugin"} {
		t.Run(typ, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ds := testenv.Mixed("e", 6)
			victim := ds[i]
			others := testenv.Without(ds, victim.Name)
			p := e.startAll(ds)
			before := e.snap(others)
			sock := fileid.Of(e.SocketPath(victim))
			regs := e.K.Counts(victim.Name).Registrations

			e.AwaitNodeInfoRecorded(p, victim)
			e.StopEndpoint(victim)
			waitDriver(t, p, victim.Name, "/status to show the endpoint down", func(d mrproc.DriverStatus) bool { return !d.EndpointUp })
			wait.Never(t, quietPeriod, "the registration of a driver whose endpoint is down moved", func() bool {
				c := e.K.Counts(victim.Name)
				return !e.K.Registered(victim.Name) || c.Deregistrations != 0 || fileid.Of(e.SocketPath(victim)) != sock
			})
			if d, _ := p.Status(t).Driver(victim.Name); d.Phase != "Registered" {
				t.Errorf("phase %q while the endpoint is down, want Registered", d.Phase)
			}

			e.StartEndpoint(victim)
			if kept := keptLine(typ); kept != "" {
				waitCount(t, p, kept, victim.Name, 1)
			} else {
				wait.For(t, registerTimeout, "the driver registered again once its endpoint is back", func() bool {
					return e.K.Counts(victim.Name).Registrations == regs+1 && e.K.Registered(victim.Name)
				})
				waitCount(t, p, restartReregistered, victim.Name, 1)
			}
			waitDriver(t, p, victim.Name, "Registered with the endpoint up", func(d mrproc.DriverStatus) bool { return d.Phase == "Registered" && d.EndpointUp })
			if c := e.K.Counts(victim.Name); keptLine(typ) != "" && (c.Registrations != regs || c.Deregistrations != 0) {
				t.Errorf("kubelet's calls after the %s's restart: %+v, want its one registration and no deregistration", typ, c)
			}
			e.assertUnmoved(before, others)
			e.holdUnmoved(before, others)
		})
	}
}

// Fault: a CSI driver's endpoint answers GetPluginInfo with another name than the configured
// one. multireg never publishes a socket for it — kubelet never hears of either name — and
// /status says why, naming both. Once the endpoint answers to the right name, it registers.
func TestEndpointWrongCSIName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("w", 6)
	victim := driver{Name: "right.csi.example.com", Type: "CSIPlugin"}
	const wrong = "wrong.csi.example.com"
	e.StartEndpoints(ds)
	e.StartEndpointAs(victim, wrong)
	p := mrproc.Start(t, e.WriteConfig(append(ds, victim)))
	e.waitRegistered(p, ds)
	before := e.snap(ds)

	d := waitDriver(t, p, victim.Name, "/status to name both names", func(d mrproc.DriverStatus) bool {
		return d.Phase == "WaitingForEndpoint" && strings.Contains(d.LastError, `"`+wrong+`"`) && strings.Contains(d.LastError, `"`+victim.Name+`"`)
	})
	t.Logf("lastError: %s", d.LastError)
	wait.Never(t, quietPeriod, "the misnamed driver reached kubelet", func() bool {
		return len(e.K.EventsFor(victim.Name)) != 0 || len(e.K.EventsFor(wrong)) != 0 || testenv.Exists(e.SocketPath(victim))
	})
	if d, _ := p.Status(t).Driver(victim.Name); d.Phase == "Registered" {
		t.Error("the misnamed driver is Registered in /status")
	}

	e.StopEndpoint(victim)
	e.StartEndpoint(victim)
	wait.For(t, registerTimeout, "the driver registered under its configured name", func() bool { return e.K.Registered(victim.Name) })
	waitPhases(t, p, []driver{victim}, "Registered")
	if len(e.K.EventsFor(wrong)) != 0 {
		t.Errorf("kubelet heard of %s", wrong)
	}
	e.assertUnmoved(before, ds)
}

// Fault: a registered CSI driver restarts under another name. multireg withdraws its socket
// (kubelet deregisters the configured name, and never hears the other), /status names both
// names, and the driver registers again when it answers to its name.
func TestEndpointRestartsUnderAnotherName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("n", 6)
	victim := ds[3] // a CSI driver
	others := testenv.Without(ds, victim.Name)
	p := e.startAll(ds)
	before := e.snap(others)
	const wrong = "impostor.csi.example.com"

	e.StopEndpoint(victim)
	e.StartEndpointAs(victim, wrong)
	wait.For(t, registerTimeout, "kubelet to deregister the driver that changed its name", func() bool {
		return !e.K.Registered(victim.Name) && e.K.Counts(victim.Name).Deregistrations == 1
	})
	waitDriver(t, p, victim.Name, "/status to name both names", func(d mrproc.DriverStatus) bool {
		return d.Phase == "WaitingForEndpoint" && strings.Contains(d.LastError, wrong) && strings.Contains(d.LastError, victim.Name)
	})
	if testenv.Exists(e.SocketPath(victim)) {
		t.Error("the withdrawn driver's socket is still there")
	}
	if len(e.K.EventsFor(wrong)) != 0 {
		t.Errorf("kubelet heard of %s", wrong)
	}

	e.StopEndpoint(victim)
	e.StartEndpoint(victim)
	wait.For(t, registerTimeout, "the driver registered again under its name", func() bool {
		return e.K.Registered(victim.Name) && e.K.Counts(victim.Name).Registrations == 2
	})
	waitPhases(t, p, []driver{victim}, "Registered")
	e.assertUnmoved(before, others)
}

// Fault: a CSI driver's endpoint, as multireg sees it (localEndpoint), holds bytes that mean
// something in a URL — '#', '%25', '?' and a space, in its directory and in its name. The
// driver is probed, published and registered like any other; no other driver moves. The path
// kubelet dials (endpoint) is a plain symlink to the same socket, as a host path mounted into
// multireg's container would be: kubelet's own gRPC clients parse the path they dial as a URL,
// so kubelet itself could not use such an endpoint.
func TestEndpointPathWithURLCharacters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("u", 6)
	p := e.startAll(ds)
	before := e.snap(ds)

	const odd = "a #%25?b"
	local := filepath.Join(e.Dir, odd, odd+".sock")
	victim := driver{Name: "odd.csi.example.com", Type: "CSIPlugin", Endpoint: filepath.Join(e.Dir, "odd.sock"),
		Extra: fmt.Sprintf("    localEndpoint: %q\n", local)}
	e.StartEndpoint(driver{Name: victim.Name, Type: victim.Type, Endpoint: local})
	if err := os.Symlink(local, victim.Endpoint); err != nil {
		t.Fatal(err)
	}
	e.WriteConfig(append(ds, victim))
	wait.For(t, registerTimeout, "the driver registered", func() bool { return e.K.Registered(victim.Name) })
	waitPhases(t, p, []driver{victim}, "Registered")
	e.assertUnmoved(before, ds)
}

// Fault: a hung endpoint: a CSI driver's socket accepts connections and never answers. Its
// probe times out (it is simply not ready), nothing is published for it, and the other
// drivers, started at the same time, register meanwhile. When a working driver replaces the
// hung one, it registers.
func TestHungEndpoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("h", 6)
	victim := driver{Name: "hung.csi.example.com", Type: "CSIPlugin"}
	e.StartEndpoints(ds)
	hung := hangingListener(t, e.EndpointPath(victim))
	p := mrproc.Start(t, e.WriteConfig(append(ds, victim)))
	e.waitRegistered(p, ds)
	before := e.snap(ds)
	d := waitDriver(t, p, victim.Name, "/status to say the hung endpoint does not answer", func(d mrproc.DriverStatus) bool {
		return d.Phase == "WaitingForEndpoint" && strings.Contains(d.LastError, "GetPluginInfo")
	})
	t.Logf("lastError: %s", d.LastError)
	wait.Never(t, quietPeriod, "the hung driver was published", func() bool {
		return testenv.Exists(e.SocketPath(victim)) || len(e.K.EventsFor(victim.Name)) != 0
	})

	hung()
	e.StartEndpoint(victim)
	wait.For(t, registerTimeout, "the driver registered once its endpoint answers", func() bool { return e.K.Registered(victim.Name) })
	waitPhases(t, p, []driver{victim}, "Registered")
	e.assertUnmoved(before, ds)
}

// hangingListener listens on path, accepts every connection and never reads nor writes. The
// returned func closes everything and removes the socket; it also runs at cleanup.
func hangingListener(t *testing.T, path string) func() {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			l.Close() // unlinks path
			<-done
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				c.Close()
			}
		})
	}
	t.Cleanup(stop)
	return stop
}
