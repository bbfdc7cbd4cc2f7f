package faults

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"multireg.dev/multireg/e2e/internal/fileid"
	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/testenv"
)

// floodEnv names the sockets a flooding child process floods (TestConnectionFloodChild).
const floodEnv = "MULTIREG_TEST_FLOOD_SOCKETS"

// Fault: a flood of connections on every registration socket (issue 28, attacks 1 and 2), from
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
	for i := range 120 {
		socks := strings.Split(v, ",")
		sock := socks[i%len(socks)]
		wg.Go(func() { flood(ctx, sock, i%2 == 0) })
	}
	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it, or goes
	cancel()
	wg.Wait()
}

// flood keeps one connection to sock open until ctx ends, opening it again whenever it is
// closed: with unfinished, it starts a NotifyRegistrationStatus whose request says 60 KiB and
// sends 32 KiB of it; otherwise it sends the HTTP/2 preface and SETTINGS only.
func flood(ctx context.Context, sock string, unfinished bool) {
	for ctx.Err() == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			select { // the socket is being published again
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		stop := context.AfterFunc(ctx, func() { c.Close() })
		if floodOnce(c, unfinished) == nil {
			_, _ = io.Copy(io.Discard, c) // until multireg closes it
		}
		stop()
		c.Close()
	}
}

func floodOnce(c net.Conn, unfinished bool) error {
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		return err
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil || !unfinished {
		return err
	}
	var b bytesBuffer
	enc := hpack.NewEncoder(&b)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", "/pluginregistration.Registration/NotifyRegistrationStatus"},
		{":authority", "localhost"}, {"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b, EndHeaders: true}); err != nil {
		return err
	}
	msg := make([]byte, 5+32<<10) // within the stream's first window
	binary.BigEndian.PutUint32(msg[1:], 60<<10)
	for len(msg) > 0 {
		n := min(len(msg), 16<<10)
		if err := fr.WriteData(1, false, msg[:n]); err != nil {
			return err
		}
		msg = msg[n:]
	}
	return nil
}

// bytesBuffer is the header block hpack writes.
type bytesBuffer []byte

func (b *bytesBuffer) Write(p []byte) (int, error) {
	*b = append(*b, p...)
	return len(p), nil
}
