//go:build linux

package main

import (
	"bufio"
	"context"
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

// serveTestHTTP serves h as the daemon does (serveHTTP) on a port of the loopback, until the
// test ends, and returns its address.
func serveTestHTTP(t *testing.T, h http.Handler) string {
	t.Helper()
	l, err := listenHTTP("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testkit.RunUntilEnd(t, func(ctx context.Context) {
		if err := serveHTTP(ctx, l, h, testkit.Logger(t)); err != nil {
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

// TestHTTPStalledRequestsMakeRoom: when every connection has a request in flight, a new one
// is served once the oldest has been in flight for httpStalled: a client that never reads
// its reply cannot keep a probe out.
func TestHTTPStalledRequestsMakeRoom(t *testing.T) {
	defer func(n int) { httpMaxConns = n }(httpMaxConns)
	httpMaxConns = 4
	var stalled atomic.Int32
	addr := serveTestHTTP(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/stall") {
			stalled.Add(1)
			<-r.Context().Done() // until its connection is closed
			return
		}
		w.Write([]byte("ok"))
	}))
	for i := range httpMaxConns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		fmt.Fprintf(c, "GET /stall/%d HTTP/1.1\r\nHost: multireg\r\n\r\n", i)
	}
	testkit.Eventually(t, 5*time.Second, "every connection with a request in flight", func() bool { return stalled.Load() == int32(httpMaxConns) })
	testkit.Eventually(t, 5*time.Second, "a new connection's request answered", func() bool {
		got, err := getOwnConn(addr, "/healthz")
		return err == nil && got == http.StatusOK
	})
}
