package images

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
)

// Import loads the docker-archive tarball at tarPath into the containerd listening on the
// unix socket ctrAddress, in namespace (the kubelet's CRI uses "k8s.io"), and unpacks it
// into the default snapshotter (overlayfs, which the CRI plugin uses too), so that a pod can
// run it without a pull. The image is stored under the tarball's name: an Image's Ref, as
// it is. Importing the same tarball again is harmless. It runs the ctr found in PATH
// and returns ctr's output in the error.
func Import(ctx context.Context, ctrAddress, namespace, tarPath string) error {
	cmd := exec.CommandContext(ctx, "ctr", "--address", ctrAddress, "--namespace", namespace,
		"images", "import", "--no-unpack=false", tarPath)
	var output bytes.Buffer
	cmd.Stdout, cmd.Stderr = &output, &output
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("ctr images import %s: %w: %s", tarPath, err, bytes.TrimSpace(output.Bytes()))
	}
	return nil
}
