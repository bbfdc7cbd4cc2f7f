package images

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"multireg.dev/multireg/hack/image/ocilayout"
)

// Pushed is a multi-platform image pushed to a registry by PushLayout.
type Pushed struct {
	// Repo is where it was pushed: REGISTRY/NAME.
	Repo string
	// Version is the tag it was pushed under, the version the layout names it by.
	Version string
	// Digest is its image index's digest, the one `make image` prints.
	Digest v1.Hash
	// Platforms holds each platform's image manifest digest ("linux/amd64" → sha256:…).
	Platforms map[string]v1.Hash
}

// Tag is the reference to the image by its tag: REGISTRY/NAME:VERSION.
func (p Pushed) Tag() string { return p.Repo + ":" + p.Version }

// ByDigest is the reference to exactly this image: REGISTRY/NAME@sha256:… (the index's).
func (p Pushed) ByDigest() string { return p.Repo + "@" + p.Digest.String() }

// PlatformNames returns the image's platforms, sorted.
func (p Pushed) PlatformNames() []string { return slices.Sorted(maps.Keys(p.Platforms)) }

// PushLayout pushes the image index held by the OCI image layout at dir — its one entry, as
// `make image` (hack/image) writes it, every platform — to repo (REGISTRY/NAME) over plain
// HTTP, tagged with the version the layout names it by.
func PushLayout(ctx context.Context, dir, repo string) (Pushed, error) {
	idx, version, err := ocilayout.Read(dir)
	if err != nil {
		return Pushed{}, err
	}
	tag, err := name.NewTag(repo+":"+version, name.Insecure, name.StrictValidation)
	if err != nil {
		return Pushed{}, fmt.Errorf("%s: tag %s:%s: %w", dir, repo, version, err)
	}
	d, err := idx.Digest()
	if err != nil {
		return Pushed{}, fmt.Errorf("%s: %w", dir, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return Pushed{}, fmt.Errorf("%s: %w", dir, err)
	}
	p := Pushed{Repo: repo, Version: version, Digest: d, Platforms: map[string]v1.Hash{}}
	for _, desc := range m.Manifests {
		if desc.Platform == nil {
			return Pushed{}, fmt.Errorf("%s: index %s: manifest %s names no platform", dir, d, desc.Digest)
		}
		p.Platforms[desc.Platform.String()] = desc.Digest
	}
	if err := remote.WriteIndex(tag, idx, remote.WithContext(ctx)); err != nil {
		return Pushed{}, fmt.Errorf("push %s to %s: %w", dir, tag, err)
	}
	return p, nil
}
