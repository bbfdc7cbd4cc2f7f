package regserver

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/testkit"
)

// BenchmarkServe measures what one socket generation costs the hub: Serve on a listening
// socket, then Stop, with n other sockets served meanwhile.
func BenchmarkServe(b *testing.B) {
	for _, n := range []int{10, 1000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			h, gs := serveTest(b, n)
			dir := filepath.Dir(gs[0].path)
			svc := Service{
				Gen:    1,
				Info:   &registerapi.PluginInfo{Type: "CSIPlugin", Name: "bench", SupportedVersions: []string{"1.0.0"}},
				Notify: func(Verdict) {}, OnInfo: func(string) {}, OnLate: func() {},
			}
			path := filepath.Join(dir, "bench.sock")
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				g, err := Serve(h, l, path, svc, nil)
				if err != nil {
					b.Fatal(err)
				}
				g.Stop() // closes l, and removes its file (Go's unlink on close)
			}
		})
	}
}

// BenchmarkRegister measures kubelet's registration of a socket as the hub serves it: a
// connection, GetInfo, the verdict, the connection closed and forgotten, with n sockets
// served. The client's side is counted too.
func BenchmarkRegister(b *testing.B) {
	for _, n := range []int{10, 1000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			h, gs := serveTest(b, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				g := gs[i%n]
				conn, err := grpc.NewClient("unix://"+g.path, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUserAgent(testkit.Kubelet136))
				if err != nil {
					b.Fatal(err)
				}
				c := registerapi.NewRegistrationClient(conn)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				if _, err := c.GetInfo(ctx, &registerapi.InfoRequest{}); err != nil {
					b.Fatal(err)
				}
				if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
					b.Fatal(err)
				}
				cancel()
				conn.Close()
			}
			b.StopTimer()
			testkit.Eventually(b, 10*time.Second, "every connection forgotten", func() bool { return h.Budget().Conns == 0 })
		})
	}
}
