package node_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/node/images"
)

// registryMark is where a scenario starts looking at the registry's requests.
type registryMark int

func markRegistry() registryMark { return registryMark(len(reg.Requests())) }

// since returns the registry's requests after m.
func (m registryMark) since() []images.Request { return reg.Requests()[m:] }

// pull is how kubelet came by a pod's image, judged on the registry's requests.
type pull int

const (
	// fetched: pulled by the reference the pod names, the node's platform image downloaded
	// from the registry.
	fetched pull = iota
	// resolved: pulled by the reference the pod names, which the registry resolved to an index
	// whose content the node holds already (nothing downloaded again).
	resolved
	// present: found on the node under that reference (IfNotPresent): the registry is not asked.
	present
)

func (p pull) String() string {
	return [...]string{"pulled", "resolved at the registry, its content on the node already", "found on the node"}[p]
}

// assertRuns checks that the multireg pod named podName runs the image want through the
// reference ref of its spec (want's tag, or want's digest), and that kubelet came by it as
// how says, judged on the registry's requests since m; no other platform's manifest than the
// node's is ever fetched. containerd's CRI plugin reports as a container's imageID the
// repository digest of the image it pulled, which for a multi-platform image is its index's
// digest (what `make image` prints and a digest pin names), not the digest of the node's
// platform manifest inside it: imageID must be REGISTRY/NAME@<index digest> exactly, whether
// the pod names the image by tag or by digest. It returns a line for the figures.
func assertRuns(t *testing.T, podName string, want images.Pushed, ref string, how pull, m registryMark) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pod, err := cl.Client.CoreV1().Pods("kube-system").Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := pod.Spec.Containers[0]
	if c.Image != ref || c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("pod %s: image %s, pull policy %s; want %s, IfNotPresent (as shipped)", pod.Name, c.Image, c.ImagePullPolicy, ref)
	}
	if len(pod.Status.ContainerStatuses) != 1 {
		t.Fatalf("pod %s: %d container statuses; want 1", pod.Name, len(pod.Status.ContainerStatuses))
	}
	cs := pod.Status.ContainerStatuses[0]
	platform := want.Platforms[hostPlatform()]
	if cs.ImageID != want.ByDigest() {
		t.Errorf("pod %s runs imageID %q (image %q); want %q: the index of %s (the %s manifest is %s)",
			pod.Name, cs.ImageID, cs.Image, want.ByDigest(), want.Tag(), hostPlatform(), platform)
	}

	reqs := m.since()
	var asked []string
	for _, r := range reqs {
		asked = append(asked, r.String())
	}
	// The tag or the digest: what follows REGISTRY/multireg and its ':' or '@'.
	reference, ok := strings.CutPrefix(ref, want.Repo)
	if !ok || len(reference) < 2 {
		t.Fatalf("reference %s is not one of %s", ref, want.Repo)
	}
	reference = reference[1:]
	manifests := "/v2/" + strings.TrimPrefix(want.Repo, reg.Host+"/") + "/manifests/"
	manifest := func(reference string) bool {
		return slices.ContainsFunc(reqs, func(r images.Request) bool {
			return r.Path == manifests+reference && r.Status == 200
		})
	}
	switch {
	case how == present && len(reqs) != 0:
		t.Errorf("pod %s: kubelet had the image %s (IfNotPresent); the registry was asked %q all the same", pod.Name, ref, asked)
	case how != present && !manifest(reference):
		t.Errorf("pod %s: the registry answered no request for the manifest %s (the pull by %s): %q", pod.Name, reference, ref, asked)
	case how == fetched && !manifest(platform.String()):
		t.Errorf("pod %s: the registry answered no request for the %s manifest %s of %s: %q", pod.Name, hostPlatform(), platform, ref, asked)
	case how == resolved && slices.ContainsFunc(reqs, func(r images.Request) bool { return strings.Contains(r.Path, "/blobs/") }):
		t.Errorf("pod %s: the node held %s's content; blobs were fetched again all the same: %q", pod.Name, ref, asked)
	}
	// Only this platform's image, ever.
	for p, d := range want.Platforms {
		if p != hostPlatform() && manifest(d.String()) {
			t.Errorf("pod %s: containerd fetched the %s manifest %s; want only %s's", pod.Name, p, d, hostPlatform())
		}
	}
	line := fmt.Sprintf("pod %s: image %s, %s (registry requests: %d); imageID %s", pod.Name, ref, how, len(reqs), cs.ImageID)
	t.Logf("%s\n  the registry's requests: %q", line, asked)
	return line
}
