package registrar

import (
	"path/filepath"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/testkit"
)

// TestKeepsDeviceEndpoints: kubelet's gRPC release, read from its registration client's user
// agent, tells whether its device manager keeps several endpoints of one resource (1.37 and
// later); whatever cannot be read is taken for an older kubelet.
func TestKeepsDeviceEndpoints(t *testing.T) {
	for agent, want := range map[string]bool{
		"grpc-go/1.65.0":                false, // kubelet 1.32
		"grpc-go/1.72.2":                false, // 1.35
		"grpc-go/1.79.3":                false, // 1.36
		"grpc-go/1.82.1":                true,  // 1.37
		"grpc-go/1.90.0":                true,
		"grpc-go/2.0.0":                 false, // not a release read here
		"grpc-go/1.79.3 grpc-go/1.85.0": false, // the first name is the client's own
		"kubelet grpc-go/1.82.1":        true,
		"":                              false,
		"grpc-java/1.82.1":              false,
		"grpc-go/1.x.0":                 false,
	} {
		if got := keepsDeviceEndpoints(agent); got != want {
			t.Errorf("keepsDeviceEndpoints(%q) = %v, want %v", agent, got, want)
		}
	}
	var k *kubeletClient
	if k.keepsDeviceEndpoints() {
		t.Error("no kubelet client: kept, want not")
	}
	k = &kubeletClient{}
	if k.keepsDeviceEndpoints() {
		t.Error("before any GetInfo: kept, want not")
	}
	k.saw(kubelet137)
	if !k.keepsDeviceEndpoints() || k.userAgent() != kubelet137 {
		t.Errorf("after kubelet 1.37's GetInfo: kept %v, agent %q", k.keepsDeviceEndpoints(), k.userAgent())
	}
}

// TestPatternDevicePluginHandover: a device plugin's new instance (dp.2) answers while the
// registered one (dp.1) still runs. On kubelet 1.37, which keeps several endpoints of one
// resource, it is registered beside the old one through the second socket, and the old
// registration is withdrawn once dp.1 is gone: kubelet's device manager promotes dp.2 and the
// resource never leaves the node. On 1.36, whose device manager would drop dp.2 when dp.1
// exits, nothing moves while dp.1 answers, and dp.2 is registered once dp.1 is gone.
func TestPatternDevicePluginHandover(t *testing.T) {
	for _, tt := range []struct {
		agent    string
		handover bool
	}{{kubelet137, true}, {kubelet136, false}} {
		t.Run(tt.agent, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			d := patternDriver(dir, config.DevicePlugin, "dp.*")
			if !d.Handover() || d.AltSocketPath == "" {
				t.Fatalf("a device plugin pattern without its second socket: %+v", d)
			}
			old := startInstance(t, d, "dp.1")
			ageFile(t, filepath.Join(filepath.Dir(d.LocalEndpoint), "dp.1"), time.Minute)
			s := runSupervisor(t, Options{})
			s.Start(d)
			awaitSocket(t, d)
			registerAs(t, d.SocketPath, tt.agent, true, "")
			testkit.Eventually(t, 5*time.Second, "Registered", func() bool { return statusOf(s, d.Name).Phase == Registered })
			first := mustID(t, d.SocketPath)

			startInstance(t, d, "dp.2")
			dp2 := filepath.Join(filepath.Dir(d.LocalEndpoint), "dp.2")
			if !tt.handover {
				testkit.Never(t, time.Second, "a move while dp.1 answers", func() bool {
					return testkit.IsSocket(d.AltSocketPath) || mustID(t, d.SocketPath) != first
				})
				old.Stop()
				testkit.Eventually(t, 5*time.Second, "a new registration socket for dp.2", func() bool {
					id, _, err := fsid.Stat(d.SocketPath)
					return err == nil && id != first
				})
				if info := registerAs(t, d.SocketPath, tt.agent, true, ""); info.Endpoint != dp2 {
					t.Errorf("GetInfo's endpoint %q, want %q", info.Endpoint, dp2)
				}
				return
			}
			testkit.Eventually(t, 5*time.Second, "the second registration socket", func() bool { return testkit.IsSocket(d.AltSocketPath) })
			if info := registerAs(t, d.AltSocketPath, tt.agent, true, ""); info.Endpoint != dp2 {
				t.Errorf("the second socket's endpoint %q, want %q", info.Endpoint, dp2)
			}
			testkit.Never(t, 500*time.Millisecond, "the old registration withdrawn while dp.1 runs", func() bool {
				id, _, err := fsid.Stat(d.SocketPath)
				return err != nil || id != first
			})
			old.Stop()
			testkit.Eventually(t, 5*time.Second, "the old registration withdrawn once dp.1 is gone", func() bool {
				return !testkit.IsSocket(d.SocketPath)
			})
			if st := statusOf(s, d.Name); st.Phase != Registered || st.Endpoint != dp2 || st.Attempts != 2 {
				t.Errorf("status: %+v, want Registered at dp.2 after 2 attempts", st)
			}
		})
	}
}
