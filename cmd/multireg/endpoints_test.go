//go:build linux

package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"multireg.dev/multireg/health"
	"multireg.dev/multireg/internal/testkit"
)

// queued reports whether a connection waits in l's accept queue, and accepts it (and closes
// it), without waiting: the descriptor is non-blocking, so accept4(2) says EAGAIN when the
// queue is empty.
func queued(t *testing.T, l net.Listener) bool {
	t.Helper()
	rc, err := l.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got bool
	var aerr error
	if err := rc.Control(func(fd uintptr) {
		nfd, _, err := unix.Accept4(int(fd), unix.SOCK_CLOEXEC)
		switch {
		case err == nil:
			unix.Close(nfd)
			got = true
		case !errors.Is(err, unix.EAGAIN):
			aerr = err
		}
	}); err != nil {
		t.Fatal(err)
	}
	if aerr != nil {
		t.Fatal(aerr)
	}
	return got
}

// TestSteerToOldest: of two sockets on one port (a rolling update's two instances), the
// kernel gives every new connection to the older while it listens, and to the younger once it
// is closed. A connection completes its handshake before Dial returns, so it is in one of the
// two queues by then.
func TestSteerToOldest(t *testing.T) {
	listen := func(addr string) net.Listener {
		l, err := listenReusePort(addr)
		if err != nil {
			t.Fatal(err)
		}
		if err := steerToOldest(l); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	older := listen("127.0.0.1:0")
	addr := older.Addr().String()
	younger := listen(addr)
	for i := range 40 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		if queued(t, younger) {
			t.Fatalf("connection %d went to the younger socket while the older listens", i+1)
		}
		if !queued(t, older) {
			t.Fatalf("connection %d is in neither queue", i+1)
		}
	}
	older.Close()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("the younger socket does not take the port's connections once the older is closed: %v", err)
	}
	c.Close()
	if !queued(t, younger) {
		t.Fatal("a connection made after the older socket closed is not in the younger's queue")
	}
}

// TestStopAnswersWhatItAccepted: stopping an endpoint answers the request of every
// connection it had accepted, even one whose request arrives after the stop began (a probe
// that reached the old instance just before a hand-over gave its socket away: http.Server's
// Shutdown alone closes such a connection unanswered, and gRPC's GracefulStop one it has not
// set up yet). The listener no longer accepts once the stop began.
func TestStopAnswersWhatItAccepted(t *testing.T) {
	checker := health.New(func(string) (health.Target, bool) { return health.Target{}, false }, testkit.Logger(t))
	defer checker.Close()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	for _, name := range []string{httpName, healthHTTPName, healthGRPCName} {
		t.Run(name, func(t *testing.T) {
			var e *endpoints
			switch name {
			case httpName:
				e = newEndpoints("127.0.0.1:0", ok, "", "", checker, nil, testkit.Logger(t))
			case healthHTTPName:
				e = newEndpoints("", nil, "127.0.0.1:0", "", checker, nil, testkit.Logger(t))
			case healthGRPCName:
				e = newEndpoints("", nil, "", "127.0.0.1:0", checker, nil, testkit.Logger(t))
			}
			if err := e.ensure(); err != nil {
				t.Fatal(err)
			}
			addr := e.served[0].l.Addr().String()
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			// Half a request: the server reads it, and waits for the rest.
			var rest func() error
			switch name {
			case httpName, healthHTTPName:
				path := "/healthz"
				if name == healthHTTPName {
					path = health.Prefix + "no-such.example.com"
				}
				fmt.Fprintf(c, "GET %s HTTP/1.1\r\n", path)
				rest = func() error {
					fmt.Fprintf(c, "Host: multireg\r\nConnection: close\r\n\r\n")
					resp, err := http.ReadResponse(bufio.NewReader(c), nil)
					if err != nil {
						return err
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if want := map[string]int{httpName: 200, healthHTTPName: 404}[name]; resp.StatusCode != want {
						return fmt.Errorf("%s, want %d", resp.Status, want)
					}
					return nil
				}
			case healthGRPCName:
				rest = func() error {
					cc, err := grpc.NewClient("passthrough:///multireg", grpc.WithTransportCredentials(insecure.NewCredentials()),
						grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return c, nil }))
					if err != nil {
						return err
					}
					defer cc.Close()
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
					if err != nil {
						return err
					}
					if resp.Status != healthpb.HealthCheckResponse_SERVING {
						return fmt.Errorf("%v, want SERVING", resp.Status)
					}
					return nil
				}
			}
			// The server accepted c: it accepts in order, and answers a request on a
			// connection made after c.
			if name != healthGRPCName {
				if _, err := getOwnConn(addr, "/healthz"); err != nil {
					t.Fatal(err)
				}
			} else {
				cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
				cancel()
				cc.Close()
				if err != nil {
					t.Fatal(err)
				}
			}
			stopped := make(chan struct{})
			go func() { e.stop(); close(stopped) }()
			testkit.Eventually(t, 10*time.Second, "the stop to close the listener", func() bool {
				d, err := net.Dial("tcp", addr)
				if err == nil {
					d.Close()
				}
				return err != nil
			})
			if err := rest(); err != nil {
				t.Errorf("the connection accepted before the stop: %v", err)
			}
			<-stopped
		})
	}
}

// TestWantedFixedPortsOnly: a hand-over's new instance asks for the listeners of a fixed port
// only: port 0 is another free port for each instance, not one they share.
func TestWantedFixedPortsOnly(t *testing.T) {
	e := newEndpoints("127.0.0.1:0", nil, ":9810", "[::1]:0", nil, nil, testkit.Logger(t))
	got := e.wanted()
	if len(got) != 1 || got[0].Name != healthHTTPName || got[0].Addr != ":9810" {
		t.Errorf("wanted %v, want only --health-endpoint's :9810", got)
	}
}
