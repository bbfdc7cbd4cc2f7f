// Package images serves the e2e cluster's container images from a registry in the test
// process (Registry), which the cluster's containerd pulls from as a cluster pulls from its
// registry (WriteHostsDir): multireg's image as `make image` builds it, every platform
// (PushLayout), and the small single-layer images the tests build themselves, such as the
// pause image (Image, PushPause), without a docker engine.
//
// An Image is linux/runtime.GOARCH, has one layer, and is reproducible: the layer's entries
// have fixed owners and mtimes, so its digest changes only when its content does.
package images

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/distribution/reference"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// defaultPath is the PATH every image's environment starts with.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Image describes a single-layer image to push with Push.
type Image struct {
	// Ref names the image, with a tag, in the normalized form that containerd stores and
	// the kubelet looks up: "127.0.0.1:5000/pause:e2e" or "docker.io/multireg/pause:e2e",
	// never "pause:e2e" (which containerd would store as "docker.io/library/pause:e2e").
	// Because Ref is normalized already, a pod spec uses Ref as it is. Push pushes to the
	// registry it names.
	Ref string
	// Files make up the image's only layer. Their parent directories are created as
	// needed, owned by 0:0 with mode 0755.
	Files []File
	// Entrypoint and Cmd are the image config's; both may be empty.
	Entrypoint []string
	Cmd        []string
	// User is the image config's user, such as "0:0"; empty means the runtime's default (root).
	User string
	// Env holds KEY=VALUE entries that follow a default PATH; an entry for PATH replaces it.
	Env []string
}

// File is one regular file in an Image's layer, owned by 0:0.
type File struct {
	// Path is the file's absolute, clean path in the image, such as "/pause".
	Path string
	// Source names the host file to copy. If it is empty, Data is the file's content.
	Source string
	Data   []byte
	// Mode holds the file's permission bits. Zero means Source's permission bits, or 0644
	// for Data.
	Mode fs.FileMode
}

// Validate reports every problem with im at once, each with its field path.
func (im Image) Validate() error {
	var errs []error
	if err := validateRef(im.Ref); err != nil {
		errs = append(errs, fmt.Errorf("ref: %q: %w", im.Ref, err))
	}
	seen := make(map[string]int, len(im.Files))
	for i, f := range im.Files {
		switch {
		case !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/":
			errs = append(errs, fmt.Errorf("files[%d].path: %q: must be an absolute, clean file path", i, f.Path))
		case seen[f.Path] > 0:
			errs = append(errs, fmt.Errorf("files[%d].path: %q: repeats files[%d]", i, f.Path, seen[f.Path]-1))
		default:
			seen[f.Path] = i + 1
		}
		if f.Source != "" && f.Data != nil {
			errs = append(errs, fmt.Errorf("files[%d]: %q: set source or data, not both", i, f.Path))
		}
		if f.Mode&^fs.ModePerm != 0 {
			errs = append(errs, fmt.Errorf("files[%d].mode: %v: only permission bits are allowed", i, f.Mode))
		}
	}
	// A file cannot also be the parent directory of another one. The loop ends at "/", or
	// at "." for a relative path.
	for i, f := range im.Files {
		for dir := path.Dir(f.Path); len(dir) > 1; dir = path.Dir(dir) {
			if j := seen[dir]; j > 0 {
				errs = append(errs, fmt.Errorf("files[%d].path: %q: files[%d] is a file, not a directory", i, f.Path, j-1))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// validateRef accepts a tagged reference without digest that containerd's normalization
// leaves unchanged, so that the name pushed, the name in containerd and in a pod spec is
// one string.
func validateRef(ref string) error {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return err
	}
	if _, ok := named.(reference.Digested); ok {
		return errors.New("must not have a digest")
	}
	if _, ok := named.(reference.Tagged); !ok {
		return errors.New("must have a tag")
	}
	if named.String() != ref {
		return fmt.Errorf("must be normalized, as %q", named.String())
	}
	return nil
}

// Push pushes im, after Validate, to the registry its Ref names, over plain HTTP (the test
// registry: see Registry), and returns the digest of its manifest.
func (im Image) Push(ctx context.Context) (v1.Hash, error) {
	img, err := im.build()
	if err != nil {
		return v1.Hash{}, err
	}
	tag, err := name.NewTag(im.Ref, name.Insecure, name.StrictValidation)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("image %s: %w", im.Ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		return v1.Hash{}, fmt.Errorf("image %s: %w", im.Ref, err)
	}
	if err := remote.Write(tag, img, remote.WithContext(ctx)); err != nil {
		return v1.Hash{}, fmt.Errorf("push %s: %w", im.Ref, err)
	}
	return d, nil
}

// build validates im, reads its files and returns the image. The layer is held in memory.
func (im Image) build() (v1.Image, error) {
	if err := im.Validate(); err != nil {
		return nil, fmt.Errorf("image %s: %w", im.Ref, err)
	}
	layerTar, err := im.layer()
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", im.Ref, err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return nil, fmt.Errorf("image %s: layer: %w", im.Ref, err)
	}

	env := []string{defaultPath}
	for _, kv := range im.Env {
		if strings.HasPrefix(kv, "PATH=") {
			env[0] = kv
			continue
		}
		env = append(env, kv)
	}
	created := v1.Time{Time: time.Unix(0, 0).UTC()}
	img, err := mutate.ConfigFile(empty.Image, &v1.ConfigFile{
		Architecture: runtime.GOARCH,
		OS:           "linux",
		Created:      created,
		RootFS:       v1.RootFS{Type: "layers"},
		Config: v1.Config{
			Entrypoint: im.Entrypoint,
			Cmd:        im.Cmd,
			User:       im.User,
			Env:        env,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("image %s: config: %w", im.Ref, err)
	}
	// Append records the layer's diff ID in the config's RootFS.
	img, err = mutate.Append(img, mutate.Addendum{
		Layer:   layer,
		History: v1.History{Created: created, CreatedBy: "multireg e2e images"},
	})
	if err != nil {
		return nil, fmt.Errorf("image %s: append layer: %w", im.Ref, err)
	}
	return img, nil
}

// layer returns the uncompressed tar of im's files and their parent directories. Entries are
// sorted by name, which puts every directory before its contents.
func (im Image) layer() ([]byte, error) {
	mtime := time.Unix(0, 0).UTC()
	files := make(map[string]File, len(im.Files))
	dirs := map[string]bool{}
	for _, f := range im.Files {
		name := strings.TrimPrefix(f.Path, "/")
		files[name] = f
		for dir := path.Dir(name); dir != "."; dir = path.Dir(dir) {
			dirs[dir] = true
		}
	}
	names := make([]string, 0, len(files)+len(dirs))
	for n := range files {
		names = append(names, n)
	}
	for d := range dirs {
		names = append(names, d)
	}
	slices.Sort(names)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		if dirs[n] {
			hdr := &tar.Header{Typeflag: tar.TypeDir, Name: n + "/", Mode: 0o755, ModTime: mtime}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, fmt.Errorf("layer: %s: %w", n, err)
			}
			continue
		}
		f := files[n]
		data, mode := f.Data, f.Mode
		if f.Source != "" {
			b, perm, err := readRegular(f.Source)
			if err != nil {
				return nil, fmt.Errorf("layer: %w", err)
			}
			data = b
			if mode == 0 {
				mode = perm
			}
		} else if mode == 0 {
			mode = 0o644
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: int64(mode), Size: int64(len(data)), ModTime: mtime}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", n, err)
		}
		if _, err := tw.Write(data); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", n, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	return buf.Bytes(), nil
}

// readRegular returns the content and permission bits of the regular file at name.
func readRegular(name string) ([]byte, fs.FileMode, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, fmt.Errorf("%s: not a regular file", name)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, 0, fmt.Errorf("read %s: %w", name, err)
	}
	return b, fi.Mode().Perm(), nil
}
