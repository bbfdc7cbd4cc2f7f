package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"multireg.dev/multireg/hack/image/ocilayout"
)

// push pushes the layout's index to image (REGISTRY/NAME) under each tag (default: the
// layout's tag) and returns what was pushed, each as NAME:TAG@DIGEST. Credentials come from
// the usual places (docker's config.json, $DOCKER_CONFIG, credential helpers).
func push(ctx context.Context, dir, image string, tags []string, insecure bool) ([]string, error) {
	idx, tag, err := ocilayout.Read(dir)
	if err != nil {
		return nil, err
	}
	if len(tags) == 0 {
		tags = []string{tag}
	}
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	repo, err := name.NewRepository(image, opts...)
	if err != nil {
		return nil, fmt.Errorf("image %q: %w", image, err)
	}
	d, err := idx.Digest()
	if err != nil {
		return nil, err
	}
	var pushed []string
	for _, t := range tags {
		tag := repo.Tag(t)
		if err := remote.WriteIndex(tag, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return pushed, fmt.Errorf("push %s: %w", tag, err)
		}
		pushed = append(pushed, fmt.Sprintf("%s@%s", tag, d))
	}
	return pushed, nil
}

// describe prints the index's digest and, per platform, its manifest's digest and the size of
// its compressed layers (what a node pulls).
func describe(w io.Writer, idx v1.ImageIndex) error {
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "index %s\n", d)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "platform\tmanifest\tcompressed\tuncompressed")
	for _, desc := range m.Manifests {
		img, err := idx.Image(desc.Digest)
		if err != nil {
			return err
		}
		compressed, uncompressed, err := layerSizes(img)
		if err != nil {
			return err
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", desc.Platform, desc.Digest, mib(compressed), mib(uncompressed))
	}
	return tw.Flush()
}

// layerSizes sums the image's layers, compressed and not.
func layerSizes(img v1.Image) (compressed, uncompressed int64, err error) {
	layers, err := img.Layers()
	if err != nil {
		return 0, 0, err
	}
	for _, l := range layers {
		n, err := l.Size()
		if err != nil {
			return 0, 0, err
		}
		compressed += n
		rc, err := l.Uncompressed()
		if err != nil {
			return 0, 0, err
		}
		u, err := io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil {
			return 0, 0, err
		}
		uncompressed += u
	}
	return compressed, uncompressed, nil
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// platformDigest returns the digest of the index's image for platform (os/arch[/variant]).
func platformDigest(idx v1.ImageIndex, platform string) (v1.Hash, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return v1.Hash{}, err
	}
	for _, d := range m.Manifests {
		if d.Platform != nil && d.Platform.String() == platform {
			return d.Digest, nil
		}
	}
	return v1.Hash{}, fmt.Errorf("no image for platform %q in the index", platform)
}
