package main

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"path"
	"reflect"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// What compare reads of two images, and what it leaves out on purpose:
//   - every file of the image's file system (its layers applied in order): path, type, mode,
//     owner, size, content digest, link target, modification time;
//   - every field of the config that a container runtime uses (entrypoint, cmd, user, env,
//     working directory, labels, ports, volumes, stop signal, ...), the platform and the
//     creation time.
// Left out: how the file system is cut into layers and described (the layers' digests, the
// config's rootfs.diff_ids and history), which depends on the builder and not on what runs:
// hack/image writes one tar of two files and one history entry naming itself, a Dockerfile
// builder its own tar of the same files and an entry per instruction. The root directory's own
// entry, which some builders write and hack/image does not: every image has a root.

// imageIn returns the image of platform (os/arch[/variant]) in the OCI image layout at dir:
// its one image, or the image of that platform in its index (make image's layout holds an
// index of every platform).
func imageIn(dir, platform string) (v1.Image, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: not an OCI image layout: %w", dir, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	return findImage(idx, platform, dir)
}

func findImage(idx v1.ImageIndex, platform, where string) (v1.Image, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	var found []v1.Image
	for _, d := range m.Manifests {
		switch {
		case d.MediaType.IsIndex():
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			img, err := findImage(child, platform, where)
			if err != nil {
				return nil, err
			}
			found = append(found, img)
		case d.MediaType.IsImage():
			img, err := idx.Image(d.Digest)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", where, err)
			}
			cfg, err := img.ConfigFile()
			if err != nil {
				return nil, fmt.Errorf("%s: %s: %w", where, d.Digest, err)
			}
			if cfg.Platform().String() == platform {
				found = append(found, img)
			}
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("%s: %d images for %s; want one", where, len(found), platform)
	}
	return found[0], nil
}

// fsEntry is one file of an image's file system.
type fsEntry struct {
	Type     string
	Mode     string
	UID, GID int
	Size     int64
	Digest   string // sha256 of a regular file's content
	Link     string
	ModTime  time.Time
}

func (e fsEntry) String() string {
	s := fmt.Sprintf("%s %s %d:%d %d bytes", e.Type, e.Mode, e.UID, e.GID, e.Size)
	if e.Digest != "" {
		s += " sha256:" + e.Digest
	}
	if e.Link != "" {
		s += " -> " + e.Link
	}
	return s + " modified " + e.ModTime.UTC().Format(time.RFC3339)
}

// fileSystem returns the image's file system: its layers applied in order, keyed by the path
// without a leading / or ./. The root's own entry is left out.
func fileSystem(img v1.Image) (map[string]fsEntry, error) {
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	fs := map[string]fsEntry{}
	for i, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w", i, err)
		}
		err = readLayer(rc, fs)
		rc.Close()
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w", i, err)
		}
	}
	return fs, nil
}

func readLayer(r io.Reader, fs map[string]fsEntry) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		base := path.Base(name)
		if base == ".wh..wh..opq" || strings.HasPrefix(base, ".wh.") {
			// A whiteout: neither image has a layer below another, so none is expected.
			return fmt.Errorf("%s: a whiteout; a FROM scratch image of one layer has none", h.Name)
		}
		if name == "" {
			continue // the root
		}
		e := fsEntry{
			Mode:    fmt.Sprintf("%04o", h.Mode&0o7777),
			UID:     h.Uid,
			GID:     h.Gid,
			Size:    h.Size,
			Link:    h.Linkname,
			ModTime: h.ModTime.UTC(),
		}
		switch h.Typeflag {
		case tar.TypeReg:
			e.Type = "file"
			sum := sha256.New()
			if _, err := io.Copy(sum, tr); err != nil {
				return err
			}
			e.Digest = hex.EncodeToString(sum.Sum(nil))
		case tar.TypeDir:
			e.Type = "dir"
		case tar.TypeSymlink:
			e.Type = "symlink"
		case tar.TypeLink:
			e.Type = "hardlink"
		default:
			e.Type = fmt.Sprintf("type %q", h.Typeflag)
		}
		fs[name] = e
	}
}

// configFields are the config fields compared, by name: the platform, the creation time and
// every field of the runtime config.
func configFields(cfg *v1.ConfigFile) map[string]any {
	f := map[string]any{
		"os":           cfg.OS,
		"architecture": cfg.Architecture,
		"variant":      cfg.Variant,
		"os.version":   cfg.OSVersion,
		"os.features":  cfg.OSFeatures,
		"author":       cfg.Author,
		"created":      cfg.Created.UTC().Format(time.RFC3339),
	}
	v := reflect.ValueOf(cfg.Config)
	for i := range v.NumField() {
		field := v.Type().Field(i)
		name := "config." + strings.Split(field.Tag.Get("json"), ",")[0]
		if name == "config." {
			name = "config." + field.Name
		}
		f[name] = v.Field(i).Interface()
	}
	return f
}

// isEmpty reports whether a config field holds nothing: the zero value, or an empty slice or map
// (builders write an absent list as null or as []).
func isEmpty(v any) bool {
	r := reflect.ValueOf(v)
	if !r.IsValid() {
		return true
	}
	switch r.Kind() {
	case reflect.Slice, reflect.Map:
		return r.Len() == 0
	case reflect.Pointer:
		return r.IsNil()
	}
	return r.IsZero()
}

// compareImages returns every difference between a and b, each a line, and what was compared.
func compareImages(a, b v1.Image) (diffs []string, compared string, err error) {
	fa, err := fileSystem(a)
	if err != nil {
		return nil, "", fmt.Errorf("a: %w", err)
	}
	fb, err := fileSystem(b)
	if err != nil {
		return nil, "", fmt.Errorf("b: %w", err)
	}
	paths := slices.Sorted(maps.Keys(fa))
	for _, p := range slices.Sorted(maps.Keys(fb)) {
		if _, ok := fa[p]; !ok {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	for _, p := range paths {
		ea, oka := fa[p]
		eb, okb := fb[p]
		switch {
		case !okb:
			diffs = append(diffs, fmt.Sprintf("/%s: only in a (%s)", p, ea))
		case !oka:
			diffs = append(diffs, fmt.Sprintf("/%s: only in b (%s)", p, eb))
		case ea != eb:
			diffs = append(diffs, fmt.Sprintf("/%s: a %s; b %s", p, ea, eb))
		}
	}

	ca, err := a.ConfigFile()
	if err != nil {
		return nil, "", fmt.Errorf("a: %w", err)
	}
	cb, err := b.ConfigFile()
	if err != nil {
		return nil, "", fmt.Errorf("b: %w", err)
	}
	ga, gb := configFields(ca), configFields(cb)
	names := slices.Sorted(maps.Keys(ga))
	for _, n := range names {
		va, vb := ga[n], gb[n]
		if isEmpty(va) && isEmpty(vb) {
			continue
		}
		if !reflect.DeepEqual(va, vb) {
			diffs = append(diffs, fmt.Sprintf("%s: a %#v; b %#v", n, va, vb))
		}
	}
	compared = fmt.Sprintf("%d files (%s), %d config fields (%s)", len(paths), strings.Join(withSlash(paths), ", "), len(names), strings.Join(names, ", "))
	return diffs, compared, nil
}

func withSlash(paths []string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = "/" + p
	}
	return out
}
