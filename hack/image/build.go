package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// defaultPlatforms are the platforms of the image, each with a binary at
// <binaries>/<os>/<arch>[/<variant>]/multireg. The Makefile's PLATFORMS builds the same list
// (image_test.go checks).
var defaultPlatforms = []string{"linux/amd64", "linux/arm64", "linux/arm/v7", "linux/ppc64le", "linux/s390x"}

// elfMachine is the ELF machine each architecture's binary must be built for.
var elfMachine = map[string]elf.Machine{
	"amd64":   elf.EM_X86_64,
	"arm64":   elf.EM_AARCH64,
	"arm":     elf.EM_ARM,
	"ppc64le": elf.EM_PPC64,
	"s390x":   elf.EM_S390,
}

// The image's files: multireg, its entrypoint; the node-condition agent it starts beside
// itself (hack/build-binary.sh builds both); the license.
const (
	binaryName = "multireg"
	agentName  = "multireg-nodecond"
	entrypoint = "/" + binaryName
	licenseIn  = "LICENSE"
)

// spec is what an image is built from: every input, so that the same spec gives the same bytes.
type spec struct {
	binaries  string   // directory of <os>/<arch>[/<variant>]/multireg
	license   string   // the LICENSE file, copied into the image beside the binary
	platforms []string // os/arch[/variant]
	version   string   // what the binaries say, e.g. v0.2.0 or v0.2.0-dev+9b9233c
	commit    string   // the full commit the binaries were built from
	source    string   // the repository's URL
	created   time.Time
}

// labels are the image's OCI annotations, as config labels and on the index.
func (s spec) labels() map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       "multireg",
		"org.opencontainers.image.description": "Registers every kubelet plugin of a node (CSI drivers, DRA drivers, device plugins) from one drivers file",
		"org.opencontainers.image.version":     s.version,
		"org.opencontainers.image.revision":    s.commit,
		"org.opencontainers.image.source":      s.source,
		"org.opencontainers.image.licenses":    "Apache-2.0",
		"org.opencontainers.image.created":     s.created.UTC().Format(time.RFC3339),
	}
}

// parsePlatform parses os/arch[/variant].
func parsePlatform(p string) (v1.Platform, error) {
	parts := strings.Split(p, "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] != "linux" {
		return v1.Platform{}, fmt.Errorf("platform %q: want linux/<arch>[/<variant>]", p)
	}
	pl := v1.Platform{OS: parts[0], Architecture: parts[1]}
	if len(parts) == 3 {
		pl.Variant = parts[2]
	}
	if _, ok := elfMachine[pl.Architecture]; !ok {
		return v1.Platform{}, fmt.Errorf("platform %q: unknown architecture", p)
	}
	return pl, nil
}

// buildIndex builds the multi-platform image index of s: one image per platform, each with one
// layer (the binary and the license), in the order of s.platforms.
func buildIndex(s spec) (v1.ImageIndex, error) {
	if s.created.IsZero() {
		return nil, fmt.Errorf("no creation time: set SOURCE_DATE_EPOCH (the commit's time)")
	}
	license, err := os.ReadFile(s.license)
	if err != nil {
		return nil, err
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	var adds []mutate.IndexAddendum
	for _, p := range s.platforms {
		pl, err := parsePlatform(p)
		if err != nil {
			return nil, err
		}
		img, err := buildImage(s, pl, license)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &pl}})
	}
	idx = mutate.AppendManifests(idx, adds...)
	return mutate.Annotations(idx, s.labels()).(v1.ImageIndex), nil
}

// buildImage builds the image of one platform.
func buildImage(s spec, pl v1.Platform, license []byte) (v1.Image, error) {
	files := []file{{name: licenseIn, mode: 0o644, data: license}}
	for _, name := range []string{binaryName, agentName} {
		bin := filepath.Join(s.binaries, filepath.FromSlash(pl.String()), name)
		b, err := os.ReadFile(bin)
		if err != nil {
			return nil, err
		}
		if err := checkBinary(b, pl); err != nil {
			return nil, fmt.Errorf("%s: %w", bin, err)
		}
		files = append(files, file{name: name, mode: 0o755, data: b})
	}
	layerTar, err := tarLayer(s.created, files)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		History: v1.History{
			Created:   v1.Time{Time: s.created},
			CreatedBy: "hack/image: " + entrypoint + ", /" + agentName + " (" + s.version + ", " + pl.String() + ") and /" + licenseIn,
		},
	})
	if err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg = cfg.DeepCopy()
	cfg.OS, cfg.Architecture, cfg.Variant = pl.OS, pl.Architecture, pl.Variant
	cfg.Created = v1.Time{Time: s.created}
	cfg.Config = v1.Config{
		Entrypoint: []string{entrypoint},
		// Root, on purpose: kubelet's plugins-registry directory is owned by root. The
		// manifests drop every capability and make the root filesystem read-only.
		User:   "0:0",
		Labels: s.labels(),
	}
	return mutate.ConfigFile(img, cfg)
}

// checkBinary refuses a binary that is not a static ELF executable for pl: a wrong GOARCH or a
// cgo build would make an image that cannot start.
func checkBinary(b []byte, pl v1.Platform) error {
	f, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("not an ELF executable: %w", err)
	}
	defer f.Close()
	if want := elfMachine[pl.Architecture]; f.Machine != want {
		return fmt.Errorf("built for %v, not %v (%s)", f.Machine, want, pl.Architecture)
	}
	if pl.Architecture == "ppc64le" && f.ByteOrder.String() != "LittleEndian" {
		return fmt.Errorf("big-endian ppc64, not ppc64le")
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("dynamically linked; the image has no libc (build with CGO_ENABLED=0)")
		}
	}
	return nil
}

// file is one regular file of a layer.
type file struct {
	name string
	mode int64
	data []byte
}

// tarLayer returns an uncompressed layer holding files, in name order, owned by root, every
// time stamp the build's creation time: the same files give the same bytes.
func tarLayer(created time.Time, files []file) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	sorted := slices.SortedFunc(slices.Values(files), func(a, b file) int { return strings.Compare(a.name, b.name) })
	for _, f := range sorted {
		hdr := &tar.Header{
			Typeflag: tar.TypeReg,
			Name:     f.name,
			Mode:     f.mode,
			Size:     int64(len(f.data)),
			ModTime:  created.UTC().Truncate(time.Second),
			Format:   tar.FormatUSTAR,
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
