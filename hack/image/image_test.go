package main

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"multireg.dev/multireg/hack/image/ocilayout"
)

var testCreated = time.Date(2026, 11, 27, 3, 0, 0, 0, time.UTC)

// fakeELF returns the smallest ELF executable header debug/elf reads for the architecture,
// with a PT_INTERP program header when dynamic: the builder reads nothing more of a binary.
func fakeELF(t testing.TB, arch string, dynamic bool) []byte {
	t.Helper()
	var buf bytes.Buffer
	order := binary.ByteOrder(binary.LittleEndian)
	data := elf.ELFDATA2LSB
	if arch == "s390x" {
		order, data = binary.BigEndian, elf.ELFDATA2MSB
	}
	var ident [elf.EI_NIDENT]byte
	copy(ident[:], elf.ELFMAG)
	ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	ident[elf.EI_DATA] = byte(data)
	phnum := uint16(0)
	if dynamic {
		phnum = 1
	}
	if arch == "arm" {
		ident[elf.EI_CLASS] = byte(elf.ELFCLASS32)
		h := elf.Header32{Ident: ident, Type: uint16(elf.ET_EXEC), Machine: uint16(elfMachine[arch]), Version: uint32(elf.EV_CURRENT),
			Phoff: 52, Ehsize: 52, Phentsize: 32, Phnum: phnum, Shentsize: 40}
		if err := binary.Write(&buf, order, h); err != nil {
			t.Fatal(err)
		}
		if dynamic {
			if err := binary.Write(&buf, order, elf.Prog32{Type: uint32(elf.PT_INTERP)}); err != nil {
				t.Fatal(err)
			}
		}
		return buf.Bytes()
	}
	ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	h := elf.Header64{Ident: ident, Type: uint16(elf.ET_EXEC), Machine: uint16(elfMachine[arch]), Version: uint32(elf.EV_CURRENT),
		Phoff: 64, Ehsize: 64, Phentsize: 56, Phnum: phnum, Shentsize: 64}
	if err := binary.Write(&buf, order, h); err != nil {
		t.Fatal(err)
	}
	if dynamic {
		if err := binary.Write(&buf, order, elf.Prog64{Type: uint32(elf.PT_INTERP)}); err != nil {
			t.Fatal(err)
		}
	}
	return buf.Bytes()
}

// testSpec writes a license and a binary per default platform (each its own bytes) into a
// temporary directory and returns the spec that builds them.
func testSpec(t testing.TB) spec {
	t.Helper()
	dir := t.TempDir()
	s := spec{
		binaries:  filepath.Join(dir, "bin"),
		license:   filepath.Join(dir, "LICENSE"),
		platforms: defaultPlatforms,
		version:   "v0.1.0",
		commit:    "0123456789abcdef0123456789abcdef01234567",
		source:    "https://github.com/multireg/multireg",
		created:   testCreated,
	}
	if err := os.WriteFile(s.license, []byte("Apache License\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range defaultPlatforms {
		pl, err := parsePlatform(p)
		if err != nil {
			t.Fatal(err)
		}
		writeBinary(t, s, p, append(fakeELF(t, pl.Architecture, false), p...))
	}
	return s
}

// writeBinary writes b as the platform's multireg, and b followed by "agent" as its agent.
func writeBinary(t testing.TB, s spec, platform string, b []byte) {
	t.Helper()
	for name, data := range map[string][]byte{binaryName: b, agentName: append(bytes.Clone(b), "agent"...)} {
		path := filepath.Join(s.binaries, filepath.FromSlash(platform), name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func mustIndex(t testing.TB, s spec) v1.ImageIndex {
	t.Helper()
	idx, err := buildIndex(s)
	if err != nil {
		t.Fatal(err)
	}
	return idx
}

func TestIndexHasEveryPlatform(t *testing.T) {
	idx := mustIndex(t, testSpec(t))
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIImageIndex {
		t.Errorf("index media type %s; want %s", m.MediaType, types.OCIImageIndex)
	}
	var got []string
	for _, d := range m.Manifests {
		got = append(got, d.Platform.String())
		if d.MediaType != types.OCIManifestSchema1 {
			t.Errorf("%s: manifest media type %s; want %s", d.Platform, d.MediaType, types.OCIManifestSchema1)
		}
	}
	want := []string{"linux/amd64", "linux/arm64", "linux/arm/v7", "linux/ppc64le", "linux/s390x"}
	if !slices.Equal(got, want) {
		t.Errorf("platforms %q; want %q", got, want)
	}
	if v := m.Annotations["org.opencontainers.image.version"]; v != "v0.1.0" {
		t.Errorf("index annotation version %q; want v0.1.0", v)
	}
}

// platformImages returns each platform's image of the index built from s, by platform.
func platformImages(t *testing.T, s spec) ([]v1.Platform, []v1.Image) {
	t.Helper()
	idx := mustIndex(t, s)
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var ps []v1.Platform
	var imgs []v1.Image
	for _, d := range m.Manifests { // every entry names its platform (TestIndex)
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		ps, imgs = append(ps, *d.Platform), append(imgs, img)
	}
	return ps, imgs
}

func TestImageConfig(t *testing.T) {
	s := testSpec(t)
	platforms, imgs := platformImages(t, s)
	for i, img := range imgs {
		pl := platforms[i]
		cfg, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		p := pl.String()
		if got := (v1.Platform{OS: cfg.OS, Architecture: cfg.Architecture, Variant: cfg.Variant}).String(); got != p {
			t.Errorf("%s: config's platform %s", p, got)
		}
		if !slices.Equal(cfg.Config.Entrypoint, []string{"/multireg"}) || cfg.Config.Cmd != nil {
			t.Errorf("%s: entrypoint %q, cmd %q; want [/multireg] and none", p, cfg.Config.Entrypoint, cfg.Config.Cmd)
		}
		if cfg.Config.User != "0:0" {
			t.Errorf("%s: user %q; want 0:0", p, cfg.Config.User)
		}
		if !cfg.Created.Time.Equal(testCreated) {
			t.Errorf("%s: created %v; want %v", p, cfg.Created, testCreated)
		}
		for k, want := range map[string]string{
			"org.opencontainers.image.version":  "v0.1.0",
			"org.opencontainers.image.revision": s.commit,
			"org.opencontainers.image.source":   s.source,
			"org.opencontainers.image.licenses": "Apache-2.0",
			"org.opencontainers.image.created":  "2026-11-27T03:00:00Z",
			"org.opencontainers.image.title":    "multireg",
		} {
			if got := cfg.Config.Labels[k]; got != want {
				t.Errorf("%s: label %s = %q; want %q", p, k, got, want)
			}
		}
		if len(cfg.History) != 1 || !strings.Contains(cfg.History[0].CreatedBy, p) {
			t.Errorf("%s: history %+v; want one entry naming the platform", p, cfg.History)
		}
	}
}

func TestLayerHoldsTheBinariesAndTheLicense(t *testing.T) {
	s := testSpec(t)
	platforms, imgs := platformImages(t, s)
	for i, img := range imgs {
		pl := platforms[i]
		layers, err := img.Layers()
		if err != nil || len(layers) != 1 {
			t.Fatalf("%s: %d layers (%v); want 1", pl, len(layers), err)
		}
		if mt, _ := layers[0].MediaType(); mt != types.OCILayer {
			t.Errorf("%s: layer media type %s; want %s", pl, mt, types.OCILayer)
		}
		rc, err := layers[0].Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		var names []string
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			names = append(names, h.Name)
			if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(testCreated) || h.Typeflag != tar.TypeReg {
				t.Errorf("%s: %s: uid %d gid %d mtime %v type %c; want a regular file of root at the creation time", pl, h.Name, h.Uid, h.Gid, h.ModTime, h.Typeflag)
			}
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			switch h.Name {
			case binaryName, agentName:
				want, err := os.ReadFile(filepath.Join(s.binaries, filepath.FromSlash(pl.String()), h.Name))
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(b, want) || h.Mode != 0o755 {
					t.Errorf("%s: /%s is not the platform's binary, mode 0755 (mode %o)", pl, h.Name, h.Mode)
				}
			case "LICENSE":
				if string(b) != "Apache License\n" || h.Mode != 0o644 {
					t.Errorf("%s: /LICENSE %q mode %o", pl, b, h.Mode)
				}
			}
		}
		rc.Close()
		if want := []string{"LICENSE", binaryName, agentName}; !slices.Equal(names, want) {
			t.Errorf("%s: layer holds %q; want %q", pl, names, want)
		}
	}
}

// Two builds of the same inputs give the same bytes, down to the layout's index.json; another
// commit gives another digest.
func TestBuildIsReproducible(t *testing.T) {
	s := testSpec(t)
	var digests []v1.Hash
	var indexJSON [][]byte
	for range 2 {
		out := filepath.Join(t.TempDir(), "layout")
		idx := mustIndex(t, s)
		if err := ocilayout.Write(out, idx, s.version); err != nil {
			t.Fatal(err)
		}
		read, version, err := ocilayout.Read(out)
		if err != nil {
			t.Fatal(err)
		}
		if version != s.version {
			t.Errorf("layout names %q; want %q", version, s.version)
		}
		d, err := read.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d)
		b, err := os.ReadFile(filepath.Join(out, "index.json"))
		if err != nil {
			t.Fatal(err)
		}
		indexJSON = append(indexJSON, b)
	}
	if digests[0] != digests[1] || !bytes.Equal(indexJSON[0], indexJSON[1]) {
		t.Errorf("two builds differ: %s and %s", digests[0], digests[1])
	}
	other := s
	other.commit = strings.Repeat("f", 40)
	if d, err := mustIndex(t, other).Digest(); err != nil || d == digests[0] {
		t.Errorf("another commit gives digest %s (%v); want another than %s", d, err, digests[0])
	}
}

func TestBuildRefuses(t *testing.T) {
	tests := []struct {
		name    string
		change  func(t *testing.T, s *spec)
		wantErr string
	}{
		{"a binary of another architecture", func(t *testing.T, s *spec) {
			writeBinary(t, *s, "linux/ppc64le", fakeELF(t, "s390x", false))
		}, "linux/ppc64le"},
		{"a dynamically linked binary", func(t *testing.T, s *spec) {
			writeBinary(t, *s, "linux/arm/v7", fakeELF(t, "arm", true))
		}, "dynamically linked"},
		{"not an executable", func(t *testing.T, s *spec) {
			writeBinary(t, *s, "linux/amd64", []byte("#!/bin/sh\n"))
		}, "not an ELF executable"},
		{"a missing binary", func(t *testing.T, s *spec) {
			if err := os.Remove(filepath.Join(s.binaries, "linux", "s390x", binaryName)); err != nil {
				t.Fatal(err)
			}
		}, "no such file"},
		{"no creation time", func(t *testing.T, s *spec) { s.created = time.Time{} }, "SOURCE_DATE_EPOCH"},
		{"an unknown platform", func(t *testing.T, s *spec) { s.platforms = []string{"linux/riscv64"} }, "unknown architecture"},
		{"another OS", func(t *testing.T, s *spec) { s.platforms = []string{"windows/amd64"} }, "want linux/"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := testSpec(t)
			tt.change(t, &s)
			_, err := buildIndex(s)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("buildIndex: %v; want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

// The layout pushes to a plain-HTTP registry on this host (go-containerregistry's own, in
// process), and pulls back by tag and by digest as the same index: what a test cluster's
// DaemonSet needs.
func TestPushToALocalRegistry(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")

	s := testSpec(t)
	dir := filepath.Join(t.TempDir(), "layout")
	t.Setenv("SOURCE_DATE_EPOCH", "1795748400")
	var out, errOut bytes.Buffer
	ctx := context.Background()
	args := []string{"build", "-binaries", s.binaries, "-license", s.license, "-version", s.version, "-commit", s.commit, "-out", dir}
	if err := run(ctx, args, &out, &errOut); err != nil {
		t.Fatalf("image build: %v\n%s", err, errOut.String())
	}
	if !regexp.MustCompile(`(?m)^index sha256:[0-9a-f]{64}\n`).Match(out.Bytes()) || strings.Count(out.String(), "MiB") != 2*len(defaultPlatforms) {
		t.Errorf("image build printed %q; want the index digest and each platform's sizes", out.String())
	}
	idx, _, err := ocilayout.Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	want, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}

	out.Reset()
	if err := run(ctx, []string{"push", "-layout", dir, "-image", host + "/multireg", "-tag", "v0.1.0", "-tag", "test"}, &out, &errOut); err != nil {
		t.Fatalf("image push: %v\n%s", err, errOut.String())
	}
	wantOut := host + "/multireg:v0.1.0@" + want.String() + "\n" + host + "/multireg:test@" + want.String() + "\n"
	if out.String() != wantOut {
		t.Errorf("image push printed %q; want %q", out.String(), wantOut)
	}
	for _, ref := range []string{host + "/multireg:v0.1.0", host + "/multireg:test", host + "/multireg@" + want.String()} {
		r, err := name.ParseReference(ref)
		if err != nil {
			t.Fatal(err)
		}
		got, err := remote.Index(r)
		if err != nil {
			t.Fatalf("pull %s: %v", ref, err)
		}
		if d, err := got.Digest(); err != nil || d != want {
			t.Errorf("pull %s: digest %s (%v); want %s", ref, d, err, want)
		}
		// A node pulls its platform's image from the index.
		arm, err := remote.Image(r, remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "arm", Variant: "v7"}))
		if err != nil {
			t.Fatalf("pull %s for linux/arm/v7: %v", ref, err)
		}
		if cfg, err := arm.ConfigFile(); err != nil || cfg.Architecture != "arm" || cfg.Variant != "v7" {
			t.Errorf("pull %s for linux/arm/v7: config %+v (%v)", ref, cfg, err)
		}
	}

	// digest prints what push pushed.
	out.Reset()
	if err := run(ctx, []string{"digest", "-layout", dir}, &out, &errOut); err != nil || out.String() != want.String()+"\n" {
		t.Errorf("image digest: %q (%v); want %s", out.String(), err, want)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run(ctx, []string{"digest", "-layout", dir, "-platform", "linux/arm/v7"}, &out, &errOut); err != nil || out.String() != m.Manifests[2].Digest.String()+"\n" {
		t.Errorf("image digest -platform linux/arm/v7: %q (%v); want %s", out.String(), err, m.Manifests[2].Digest)
	}
	if err := run(ctx, []string{"digest", "-layout", dir, "-platform", "linux/riscv64"}, io.Discard, io.Discard); err == nil {
		t.Error("image digest -platform linux/riscv64: no error")
	}
}

func TestPushRefuses(t *testing.T) {
	ctx := context.Background()
	if _, err := push(ctx, t.TempDir(), "127.0.0.1:1/multireg", nil, false); err == nil || !strings.Contains(err.Error(), "not an OCI image layout") {
		t.Errorf("push of an empty directory: %v; want not an OCI image layout", err)
	}
	s := testSpec(t)
	dir := filepath.Join(t.TempDir(), "layout")
	if err := ocilayout.Write(dir, mustIndex(t, s), s.version); err != nil {
		t.Fatal(err)
	}
	if _, err := push(ctx, dir, "Not A Name", nil, false); err == nil || !strings.Contains(err.Error(), `image "Not A Name"`) {
		t.Errorf("push to a malformed name: %v", err)
	}
	if err := run(ctx, []string{"build", "-binaries", s.binaries}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "required") {
		t.Errorf("build without -version: %v", err)
	}
	t.Setenv("SOURCE_DATE_EPOCH", "")
	args := []string{"build", "-binaries", s.binaries, "-license", s.license, "-version", s.version, "-commit", s.commit, "-out", dir}
	if err := run(ctx, args, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "SOURCE_DATE_EPOCH") {
		t.Errorf("build without SOURCE_DATE_EPOCH: %v", err)
	}
}

// The Makefile builds a binary for exactly the platforms the image has.
func TestMakefilePlatforms(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^PLATFORMS\s*:?=\s*(.*)$`).FindSubmatch(b)
	if m == nil {
		t.Fatal("the Makefile has no PLATFORMS")
	}
	if got := strings.Fields(string(m[1])); !slices.Equal(got, defaultPlatforms) {
		t.Errorf("the Makefile's PLATFORMS %q; the image's %q", got, defaultPlatforms)
	}
}

// A development build's version (semver build metadata after a +) names the layout's entry,
// the tag it is pushed under, with a dot instead: a tag may not hold a +. The labels keep the
// version as the binaries say it. A tag given that no registry takes is refused.
func TestBuildTagsADevelopmentVersion(t *testing.T) {
	s := testSpec(t)
	t.Setenv("SOURCE_DATE_EPOCH", "1795748400")
	ctx := context.Background()
	build := func(extra ...string) (string, error) {
		dir := filepath.Join(t.TempDir(), "layout")
		args := append([]string{"build", "-binaries", s.binaries, "-license", s.license, "-version", "v0.2.0-dev+9b9233c-dirty", "-commit", s.commit, "-out", dir}, extra...)
		return dir, run(ctx, args, io.Discard, io.Discard)
	}
	dir, err := build()
	if err != nil {
		t.Fatal(err)
	}
	idx, tag, err := ocilayout.Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if tag != "v0.2.0-dev.9b9233c-dirty" {
		t.Errorf("the layout's tag %q; want v0.2.0-dev.9b9233c-dirty", tag)
	}
	if _, err := name.NewTag("registry.example/multireg:"+tag, name.StrictValidation); err != nil {
		t.Errorf("tag %q: %v", tag, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if v := m.Annotations["org.opencontainers.image.version"]; v != "v0.2.0-dev+9b9233c-dirty" {
		t.Errorf("the index's version %q; want the binaries' v0.2.0-dev+9b9233c-dirty", v)
	}

	if dir, err = build("-tag", "v0.2.0-rc.1"); err != nil {
		t.Fatal(err)
	}
	if _, tag, err := ocilayout.Read(dir); err != nil || tag != "v0.2.0-rc.1" {
		t.Errorf("with -tag v0.2.0-rc.1: the layout's tag %q (%v)", tag, err)
	}
	if _, err := build("-tag", "v0.2.0+build"); err == nil || !strings.Contains(err.Error(), `tag "v0.2.0+build"`) {
		t.Errorf("with -tag v0.2.0+build: %v; want it refused", err)
	}
}
