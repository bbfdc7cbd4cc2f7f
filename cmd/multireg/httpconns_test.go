//go:build linux

package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"multireg.dev/multireg/internal/testkit"
)

// serveTestHTTP serves h as the daemon does (endpoints) on a port of the loopback, until the
// test ends, and returns its address.
func serveTestHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	return serveTestHTTPWith(t, h, nil)
}

// serveTestHTTPWith is serveTestHTTP with the connection cap changed by lower, if not nil.
func serveTestHTTPWith(t *testing.T, h http.Handler, lower func(*connCap)) string {
	t.Helper()
	l, err := listenReusePort("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cc := newConnCap(testkit.Logger(t))
	if lower != nil {
		lower(cc)
	}
	srv := newHTTPServer(h, cc, httpWriteTimeout, testkit.Logger(t))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		shutdownHTTP(srv)
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Error(err)
		}
	})
	return l.Addr().String()
}

// getOwnConn asks addr for path on a connection of its own, and returns the reply's status.
func getOwnConn(addr, path string) (int, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: multireg\r\nConnection: close\r\n\r\n", path)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// closedByPeer reports whether the other end closed c (a read ends other than by its deadline).
func closedByPeer(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(time.Millisecond))
	_, err := c.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// TestHTTPConnectionsBounded: connections that never finish their request headers, far more
// than the bound, are closed down to it, oldest first, long before the read timeout, and a
// new connection's request is answered meanwhile.
func TestHTTPConnectionsBounded(t *testing.T) {
	addr := serveTestHTTP(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok")) }))
	var flood []net.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	const n = 300
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprint(c, "GET /healthz HTTP/1.1\r\nHost: multireg\r\n") // headers never end
		flood = append(flood, c)
	}
	closed := func() int {
		k := 0
		for _, c := range flood {
			if closedByPeer(c) {
				k++
			}
		}
		return k
	}
	testkit.Eventually(t, httpReadTimeout/2, fmt.Sprintf("%d of %d connections closed", n-httpMaxConns, n), func() bool { return closed() >= n-httpMaxConns })
	if got, err := getOwnConn(addr, "/healthz"); err != nil || got != http.StatusOK {
		t.Fatalf("a request beside the flood: %d, %v", got, err)
	}
	for i, c := range flood[n-httpMaxConns+1:] { // the newest, but for the one the request took
		if closedByPeer(c) {
			t.Fatalf("connection %d of %d, among the newest, was closed", n-httpMaxConns+1+i, n)
		}
	}
}

// stallingServer serves /stall/N, whose handler returns only once its connection is closed,
// and counts the requests in it and those that returned; other paths answer at once. Its
// connection cap keeps maxConns connections, and cuts requests in flight for stalled.
func stallingServer(t *testing.T, maxConns int, stalled time.Duration) (addr string, in, out *atomic.Int32) {
	in, out = new(atomic.Int32), new(atomic.Int32)
	lower := func(cc *connCap) { cc.maxConns, cc.stalled = maxConns, stalled }
	addr = serveTestHTTPWith(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/stall") {
			in.Add(1)
			<-r.Context().Done() // until its connection is closed
			out.Add(1)
			return
		}
		w.Write([]byte("ok"))
	}), lower)
	return addr, in, out
}

// stall opens n connections to addr, each with a request in the stalling handler, and waits
// until they are all in it (in counts n more). A connection closed before its request got in
// (the server had yet to see an earlier one close) is opened again.
func stall(t *testing.T, addr string, n int, in *atomic.Int32) []net.Conn {
	var cs []net.Conn
	for i := range n {
		want := in.Load() + 1
		var c net.Conn
		testkit.Eventually(t, 5*time.Second, "a connection with a request in flight", func() bool {
			if in.Load() == want {
				return true
			}
			if c == nil || closedByPeer(c) {
				var err error
				if c, err = net.Dial("tcp", addr); err != nil {
					t.Fatal(err)
				}
				opened := c
				t.Cleanup(func() { opened.Close() })
				fmt.Fprintf(c, "GET /stall/%d HTTP/1.1\r\nHost: multireg\r\n\r\n", i)
			}
			return false
		})
		cs = append(cs, c)
	}
	return cs
}

// TestHTTPStalledRequestsMakeRoom: when every connection has a request in flight for
// httpStalled, a new one is served in place of the oldest: a client that never reads its
// reply cannot keep a probe out.
func TestHTTPStalledRequestsMakeRoom(t *testing.T) {
	const maxConns = 4
	addr, in, out := stallingServer(t, maxConns, 0) // every request in flight is stalled at once
	cs := stall(t, addr, maxConns, in)
	if got, err := getOwnConn(addr, "/healthz"); err != nil || got != http.StatusOK {
		t.Fatalf("a request beside stalled ones: %d, %v", got, err)
	}
	testkit.Eventually(t, 5*time.Second, "a stalled request cut", func() bool { return out.Load() == 1 })
	closed := 0
	for _, c := range cs {
		if closedByPeer(c) {
			closed++
		}
	}
	if closed != 1 {
		t.Errorf("%d connections with a stalled request closed, want 1", closed)
	}
}

// TestHTTPRequestsInFlightAreNotCut: a request in flight for less than httpStalled is never
// cut for a new connection: the new one is closed instead, and a connection waiting for its
// request is closed before either.
func TestHTTPRequestsInFlightAreNotCut(t *testing.T) {
	const maxConns = 4
	addr, in, out := stallingServer(t, maxConns, time.Hour)
	cs := stall(t, addr, maxConns-1, in)
	waiting, err := net.Dial("tcp", addr) // no request yet
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { waiting.Close() })
	testkit.Eventually(t, 5*time.Second, "a request answered in place of the waiting connection", func() bool {
		got, err := getOwnConn(addr, "/healthz")
		return err == nil && got == http.StatusOK
	})
	if !closedByPeer(waiting) {
		t.Error("the connection waiting for its request is still open")
	}
	cs = append(cs, stall(t, addr, 1, in)...) // every connection's request in flight now
	if _, err := getOwnConn(addr, "/healthz"); err == nil {
		t.Error("a request answered beyond the bound, with every other connection's request in flight")
	}
	for i, c := range cs {
		if closedByPeer(c) {
			t.Errorf("connection %d, with a request in flight, was closed", i)
		}
	}
	if n := out.Load(); n != 0 {
		t.Errorf("%d requests in flight cut", n)
	}
}
