package images

import (
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"multireg.dev/multireg/hack/image/ocilayout"
)

// testIndex returns an image index of two platforms, each image holding its own file.
func testIndex(t *testing.T) v1.ImageIndex {
	t.Helper()
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range []v1.Platform{{OS: "linux", Architecture: "amd64"}, {OS: "linux", Architecture: "arm", Variant: "v7"}} {
		img, err := Image{Ref: testRef, Files: []File{{Path: "/multireg", Data: []byte(p.String())}}}.build()
		if err != nil {
			t.Fatal(err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	return idx
}

// writeTestLayout writes the entries as an OCI image layout in a new directory, each entry
// annotated with annotations, and returns the directory.
func writeTestLayout(t *testing.T, annotations map[string]string, entries ...v1.ImageIndex) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if err := p.AppendIndex(e, layout.WithAnnotations(annotations)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// A layout as make image writes it is pushed whole, by its version's tag, and the registry
// serves the same index by tag and by digest, and each platform's image from it.
func TestPushLayout(t *testing.T) {
	reg := startRegistry(t)
	idx := testIndex(t)
	dir := writeTestLayout(t, map[string]string{ocilayout.RefName: "v9.8.7"}, idx)
	want, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}

	p, err := PushLayout(t.Context(), dir, reg.Host+"/multireg")
	if err != nil {
		t.Fatal(err)
	}
	if p.Tag() != reg.Host+"/multireg:v9.8.7" || p.ByDigest() != reg.Host+"/multireg@"+want.String() || p.Digest != want {
		t.Errorf("pushed %s, %s (digest %s); want the tag v9.8.7 and the index's digest %s", p.Tag(), p.ByDigest(), p.Digest, want)
	}
	wantPlatforms := map[string]v1.Hash{"linux/amd64": m.Manifests[0].Digest, "linux/arm/v7": m.Manifests[1].Digest}
	if !maps.Equal(p.Platforms, wantPlatforms) {
		t.Errorf("platforms %v; want %v", p.Platforms, wantPlatforms)
	}
	for _, ref := range []string{p.Tag(), p.ByDigest()} {
		r, err := name.ParseReference(ref, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		got, err := remote.Index(r, remote.WithContext(t.Context()))
		if err != nil {
			t.Fatalf("pull %s: %v", ref, err)
		}
		if d, err := got.Digest(); err != nil || d != want {
			t.Errorf("pull %s: digest %s (%v); want %s", ref, d, err, want)
		}
		arm, err := remote.Image(r, remote.WithContext(t.Context()), remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "arm", Variant: "v7"}))
		if err != nil {
			t.Fatalf("pull %s for linux/arm/v7: %v", ref, err)
		}
		if d, err := arm.Digest(); err != nil || d != wantPlatforms["linux/arm/v7"] {
			t.Errorf("pull %s for linux/arm/v7: %s (%v); want %s", ref, d, err, wantPlatforms["linux/arm/v7"])
		}
	}
	var puts []string
	for _, r := range reg.Requests() {
		if r.Method == "PUT" && strings.Contains(r.Path, "/manifests/") {
			puts = append(puts, r.Path)
		}
	}
	// Both platforms' manifests by digest, then the index by its tag.
	if len(puts) != 3 || puts[2] != "/v2/multireg/manifests/v9.8.7" ||
		!slices.Contains(puts, "/v2/multireg/manifests/"+m.Manifests[0].Digest.String()) ||
		!slices.Contains(puts, "/v2/multireg/manifests/"+m.Manifests[1].Digest.String()) {
		t.Errorf("manifests pushed: %q; want both platforms' and the index by its tag", puts)
	}
}

func TestPushLayoutRefuses(t *testing.T) {
	reg := startRegistry(t)
	idx := testIndex(t)
	img, err := Image{Ref: testRef}.build()
	if err != nil {
		t.Fatal(err)
	}
	imageOnly := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(imageOnly, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{ocilayout.RefName: "v1"})); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tt := range []struct {
		name, dir, wantErr string
	}{
		{"not a layout", missing, missing + ": not an OCI image layout (make image writes one)"},
		{"no version", writeTestLayout(t, nil, idx), "has no org.opencontainers.image.ref.name annotation"},
		{"two indexes", writeTestLayout(t, map[string]string{ocilayout.RefName: "v1"}, idx, idx), "want one image index, as make image writes, found 2 entries"},
		{"an image, no index", imageOnly, "want one image index"},
		{"a version that is no tag", writeTestLayout(t, map[string]string{ocilayout.RefName: "v1+build"}, idx), "tag " + reg.Host + "/multireg:v1+build"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := PushLayout(t.Context(), tt.dir, reg.Host+"/multireg")
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("PushLayout = %v; want an error containing %q", err, tt.wantErr)
			}
		})
	}
	if reqs := reg.Requests(); len(reqs) != 0 {
		t.Errorf("the registry was asked %v; want nothing", reqs)
	}
}
