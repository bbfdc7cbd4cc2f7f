package registrar

import (
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestVerdictWithoutGetInfoIgnored: kubelet's client reconnects to a recreated socket at the
// same path, so a verdict about an older socket can arrive on the new one, on a connection
// that never asked the new one's GetInfo. It must not count.
func TestVerdictWithoutGetInfoIgnored(t *testing.T) {
	s, d, _ := setup(t, config.DevicePlugin, nil)
	awaitSocket(t, d)
	late := dialKubelet(t, d.SocketPath)
	late.Notify(t, false, "about an older socket")
	testkit.Never(t, time.Second, "a verdict without GetInfo counted", func() bool {
		st := statusOf(s, d.Name)
		return st.Phase != Serving || st.Failures != 0
	})
	registerAndWait(t, s, d) // GetInfo, then the verdict, on one connection: counts
}

// Messages larger than an HTTP/2 frame — a PluginInfo with many versions — go through whole,
// and a rejection from kubelet up to the bound on requests (16 KiB; kubelet's are some hundred
// bytes).
func TestMessagesLargerThanTheTransportBuffers(t *testing.T) {
	dir := testkit.ShortDir(t)
	ep := filepath.Join(dir, "ep", "csi.sock")
	startEndpoint(t, ep, "big.csi.k8s.io")
	d := testDriver(dir, "big.csi.k8s.io", config.CSIPlugin, ep)
	d.SupportedVersions = nil
	for i := range 2000 {
		d.SupportedVersions = append(d.SupportedVersions, fmt.Sprintf("1.%d.0", i)) // ≈ 16 KiB
	}
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)

	reason := strings.Repeat("kubelet says no. ", 900) // 15 KiB
	info := register(t, d.SocketPath, false, reason)
	if !reflect.DeepEqual(info.SupportedVersions, d.SupportedVersions) {
		t.Errorf("GetInfo returned %d versions, want all %d", len(info.SupportedVersions), len(d.SupportedVersions))
	}
	testkit.Eventually(t, 5*time.Second, "the whole rejection in lastError", func() bool {
		return strings.Contains(statusOf(s, d.Name).LastError, reason)
	})
}
