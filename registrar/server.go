package registrar

import (
	"context"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// verdict is kubelet's answer to one socket generation.
type verdict struct {
	gen        uint64
	registered bool
	msg        string
}

// registrationServer serves kubelet's Registration API on one socket generation. GetInfo is
// answered from memory: kubelet allows it one second.
type registrationServer struct {
	registerapi.UnsafeRegistrationServer

	gen    uint64
	info   *registerapi.PluginInfo
	notify func(verdict) // must not block
	onInfo func()        // called on every GetInfo; must not block
}

var _ registerapi.RegistrationServer = (*registrationServer)(nil)

func (s *registrationServer) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	s.onInfo()
	return s.info, nil
}

// NotifyRegistrationStatus hands kubelet's verdict to the loop and always answers normally:
// a failure is the loop's to handle, in the background.
func (s *registrationServer) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	s.notify(verdict{gen: s.gen, registered: st.PluginRegistered, msg: st.Error})
	return &registerapi.RegistrationStatusResponse{}, nil
}

// generation is one published registration socket and the gRPC server on it.
type generation struct {
	gen  uint64
	path string
	id   fileID
	srv  *grpc.Server
	done chan struct{} // closed when Serve has returned
	once sync.Once
}

// serve starts a gRPC server for rs on l. No idle or age limits: kubelet keeps one
// connection open from GetInfo to NotifyRegistrationStatus, and the plugin's registration in
// between may take minutes.
func serve(l net.Listener, path string, id fileID, rs *registrationServer) *generation {
	g := &generation{gen: rs.gen, path: path, id: id, srv: grpc.NewServer(), done: make(chan struct{})}
	registerapi.RegisterRegistrationServer(g.srv, rs)
	go func() {
		defer close(g.done)
		_ = g.srv.Serve(l) // returns when stop closes the listener
	}()
	return g
}

// stopGrace bounds how long a stopping generation lets calls in flight finish: the reply to
// the NotifyRegistrationStatus that made the loop stop it must reach kubelet.
const stopGrace = time.Second

// stop closes the listener, lets calls in flight finish (for at most stopGrace), closes every
// connection and waits for the server to finish. The socket file stays. It is idempotent.
func (g *generation) stop() {
	g.once.Do(func() {
		graceful := make(chan struct{})
		go func() {
			defer close(graceful)
			g.srv.GracefulStop()
		}()
		t := time.NewTimer(stopGrace)
		defer t.Stop()
		select {
		case <-graceful:
		case <-t.C:
			g.srv.Stop()
			<-graceful
		}
	})
	<-g.done
}
