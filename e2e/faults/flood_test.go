package faults

import (
	"context"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"multireg.dev/multireg/e2e/h2flood"
	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/testenv"
)

// floodEnv names the sockets a flooding child process floods (TestConnectionFloodChild).
const floodEnv = "MULTIREG_TEST_FLOOD_SOCKETS"

// Fault: a flood of connections on every registration socket, from
// a process of its own as a hostile peer's: connections that send only the HTTP/2 preface, and
// connections that start a request and never finish it, 20 a socket, each opened again as soon
// as multireg closes it. Meanwhile a driver's socket is deleted: multireg publishes it again
// and kubelet's real plugin manager registers it, multireg stays healthy, and nothing else
// moves. (Its memory under the shipped limit is measured by e2e/cmd/attack.)
func TestConnectionFlood(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("fl", 6)
	target := ds[0]
	p := e.startAll(ds)
	others := ds[1:]
	before := e.snap(others)

	var socks []string
	for _, d := range ds {
		socks = append(socks, e.SocketPath(d))
	}
	child := exec.Command(os.Args[0], "-test.run=^TestConnectionFloodChild$", "-test.timeout=5m")
	child.Env = append(os.Environ(), floodEnv+"="+strings.Join(socks, ","))
	stdin, err := child.StdinPipe() // the child floods until its stdin closes
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		_ = child.Wait()
	}()
	wait.For(t, registerTimeout, "the flood under way", func() bool {
		return p.Count("refusing or cutting clients of the registration sockets beyond multireg's bounds", "") > 0
	})

	first := fileid.Of(e.SocketPath(target))
	if err := os.Remove(e.SocketPath(target)); err != nil {
		t.Fatal(err)
	}
	wait.Every(t, requestPoll, registerTimeout, "the deleted socket published again and registered by kubelet during the flood", func() bool {
		sock := e.SocketPath(target)
		return testenv.IsSocket(sock) && fileid.Of(sock) != first && e.K.Registered(target.Name) && p.Phase(target.Name) == "Registered"
	})
	if !p.Healthy(t) {
		t.Error("/healthz does not answer 200 during the flood")
	}
	e.assertUnmoved(before, others)
}

// TestConnectionFloodChild is TestConnectionFlood's flooding process; it does nothing unless
// that test started it.
func TestConnectionFloodChild(t *testing.T) {
	v := os.Getenv(floodEnv)
	if v == "" {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	// Unfinished requests of 8 KiB: within the bound on a request (16 KiB), so that they are
	// held, not refused at once.
	idle, unfinished := &h2flood.Flood{}, &h2flood.Flood{Unfinished: true, Size: 8 << 10}
	socks := strings.Split(v, ",")
	for i := range 120 {
		f := idle
		if i%2 == 0 {
			f = unfinished
		}
		wg.Go(func() { f.Hold(ctx, socks[i%len(socks)]) })
	}
	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it, or goes
	cancel()
	wg.Wait()
}
