package testkit

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// The user agents of kubelet's registration client: kubelet 1.36 was built with gRPC 1.79,
// 1.37 with 1.82. gRPC appends its own ("grpc-go/<this module's gRPC>"), which the first name
// hides.
const (
	Kubelet136 = "grpc-go/1.79.3"
	Kubelet137 = "grpc-go/1.82.1"
)

// Kubelet plays kubelet's side of a registration socket: a Registration client on it.
type Kubelet struct {
	Conn *grpc.ClientConn
	C    registerapi.RegistrationClient
}

// DialKubelet dials the registration socket as a kubelet whose registration client's user
// agent is agent; the connection closes when the test ends.
func DialKubelet(t testing.TB, socket, agent string) *Kubelet {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUserAgent(agent))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &Kubelet{Conn: conn, C: registerapi.NewRegistrationClient(conn)}
}

// GetInfo calls GetInfo. kubelet allows one second; the tests allow five, which a loaded
// machine under the race detector needs, and no test here is about GetInfo's latency.
func (k *Kubelet) GetInfo(t testing.TB) *registerapi.PluginInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	info, err := k.C.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	return info
}

// Notify sends kubelet's verdict.
func (k *Kubelet) Notify(t testing.TB, registered bool, msg string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := k.C.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: registered, Error: msg}); err != nil {
		t.Fatalf("NotifyRegistrationStatus(%v): %v", registered, err)
	}
}

// Register plays kubelet's part for the socket now at path: GetInfo, then the verdict, on one
// connection.
func Register(t testing.TB, socket, agent string, ok bool, msg string) *registerapi.PluginInfo {
	t.Helper()
	k := DialKubelet(t, socket, agent)
	info := k.GetInfo(t)
	k.Notify(t, ok, msg)
	return info
}
