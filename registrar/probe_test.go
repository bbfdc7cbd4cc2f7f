package registrar

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"multireg.dev/multireg/config"
)

// TestProbeAnyPath: a CSI endpoint whose path holds bytes that mean something in a URL ('#',
// '%', '?', a space) is probed like any other, and its driver is published: validation
// accepts such paths.
func TestProbeAnyPath(t *testing.T) {
	dir := shortDir(t)
	for _, name := range []string{"a#b", "a%25b", "a%zz", "a?b", "a b", "a #%25?b"} {
		ep := filepath.Join(dir, name, name+".sock")
		startEndpoint(t, ep, "nfs.csi.k8s.io")
		d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, ep)
		if err := probeEndpoint(context.Background(), d); err != nil {
			t.Errorf("probe of %q: %v", ep, err)
		}
		d.Name = "smb.csi.k8s.io"
		if err := probeEndpoint(context.Background(), d); !errors.As(err, new(*nameMismatchError)) {
			t.Errorf("probe of %q under another name: %v, want a name mismatch", ep, err)
		}
	}

	d := testDriver(dir, "nfs.csi.k8s.io", config.CSIPlugin, filepath.Join(dir, "a #%25?b", "a #%25?b.sock"))
	s := runSupervisor(t, Options{})
	s.Start(d)
	awaitSocket(t, d)
}
