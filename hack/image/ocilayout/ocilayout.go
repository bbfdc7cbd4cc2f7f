// Package ocilayout writes and reads the OCI image layout `make image` produces: one entry, the
// multi-platform image index, named by its tag (the version the build says, with a + made a dot:
// the tag it is pushed under).
// hack/image writes and pushes it; the end-to-end tests of the real node push it to their
// registry.
package ocilayout

import (
	"fmt"
	"os"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// RefName is the annotation of the layout's entry that names it: its tag.
const RefName = "org.opencontainers.image.ref.name"

// Write writes idx as the one entry of a fresh OCI image layout at dir, named by tag.
func Write(dir string, idx v1.ImageIndex, tag string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendIndex(idx, layout.WithAnnotations(map[string]string{RefName: tag}))
}

// Read returns the image index that is the one entry of the layout at dir, and the tag its
// entry is named by.
func Read(dir string) (v1.ImageIndex, string, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, "", fmt.Errorf("%s: not an OCI image layout (make image writes one): %w", dir, err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", dir, err)
	}
	m, err := top.IndexManifest()
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", dir, err)
	}
	if len(m.Manifests) != 1 || !m.Manifests[0].MediaType.IsIndex() {
		return nil, "", fmt.Errorf("%s: want one image index, as make image writes, found %d entries", dir, len(m.Manifests))
	}
	tag := m.Manifests[0].Annotations[RefName]
	if tag == "" {
		return nil, "", fmt.Errorf("%s: the image index has no %s annotation (its tag, to push)", dir, RefName)
	}
	idx, err := top.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", dir, err)
	}
	return idx, tag, nil
}
