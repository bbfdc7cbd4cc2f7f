package images

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

const testRef = "multireg.test/pause:e2e"

// pauseImage builds the pause binary into dir and returns an image holding it and a data file,
// named HOST/pause:e2e.
func pauseImage(t *testing.T, dir, host string) Image {
	t.Helper()
	start := time.Now()
	bin, err := BuildPause(t.Context(), dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("BuildPause: %v", time.Since(start))
	return Image{
		Ref: host + "/pause:e2e",
		Files: []File{
			{Path: "/pause", Source: bin, Mode: 0o755},
			{Path: "/etc/multireg/hello", Data: []byte("hello\n")},
		},
		Entrypoint: []string{"/pause"},
		User:       "0:0",
		Env:        []string{"GREETING=hi"},
	}
}

// pull reads ref back from its registry (plain HTTP).
func pull(t *testing.T, ref string) v1.Image {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r, remote.WithContext(t.Context()))
	if err != nil {
		t.Fatalf("pull %s: %v", ref, err)
	}
	return img
}

func TestPush(t *testing.T) {
	reg := startRegistry(t)
	dir := t.TempDir()
	im := pauseImage(t, dir, reg.Host)
	pauseBin, err := os.ReadFile(im.Files[0].Source)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	digest, err := im.Push(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Push: %v", time.Since(start))

	img := pull(t, im.Ref)
	if d, err := img.Digest(); err != nil || d != digest {
		t.Errorf("pulled %s: digest %v (%v), want the pushed %v", im.Ref, d, err, digest)
	}
	if d, err := pull(t, reg.Host+"/pause@"+digest.String()).Digest(); err != nil || d != digest {
		t.Errorf("pulled by digest: %v (%v), want %v", d, err, digest)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH {
		t.Errorf("platform = %s/%s, want linux/%s", cfg.OS, cfg.Architecture, runtime.GOARCH)
	}
	if !slices.Equal(cfg.Config.Entrypoint, im.Entrypoint) || cfg.Config.Cmd != nil {
		t.Errorf("entrypoint, cmd = %q, %q, want %q, none", cfg.Config.Entrypoint, cfg.Config.Cmd, im.Entrypoint)
	}
	if cfg.Config.User != "0:0" {
		t.Errorf("user = %q, want 0:0", cfg.Config.User)
	}
	if want := []string{defaultPath, "GREETING=hi"}; !slices.Equal(cfg.Config.Env, want) {
		t.Errorf("env = %q, want %q", cfg.Config.Env, want)
	}

	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("%d layers, want 1", len(layers))
	}
	diffID, err := layers[0].DiffID()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.RootFS.DiffIDs, []v1.Hash{diffID}) {
		t.Errorf("rootfs diff IDs = %v, want [%v] (the layer's)", cfg.RootFS.DiffIDs, diffID)
	}

	type entry struct {
		name string
		kind byte
		mode int64
		data string
	}
	want := []entry{
		{"etc/", tar.TypeDir, 0o755, ""},
		{"etc/multireg/", tar.TypeDir, 0o755, ""},
		{"etc/multireg/hello", tar.TypeReg, 0o644, "hello\n"},
		{"pause", tar.TypeReg, 0o755, string(pauseBin)},
	}
	var got []entry
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Uid != 0 || hdr.Gid != 0 || !hdr.ModTime.Equal(time.Unix(0, 0)) {
			t.Errorf("%s: owner %d:%d, mtime %v, want 0:0 and the epoch", hdr.Name, hdr.Uid, hdr.Gid, hdr.ModTime)
		}
		got = append(got, entry{hdr.Name, hdr.Typeflag, hdr.Mode, string(data)})
	}
	if !slices.Equal(got, want) {
		for _, e := range got {
			t.Logf("got %s type %c mode %o, %d bytes", e.name, e.kind, e.mode, len(e.data))
		}
		t.Errorf("layer entries differ from the %d wanted", len(want))
	}
	if !slices.ContainsFunc(reg.Requests(), func(r Request) bool {
		return r.Method == "PUT" && r.Path == "/v2/pause/manifests/e2e" && r.Status == 201
	}) {
		t.Errorf("the registry's requests hold no PUT /v2/pause/manifests/e2e answered 201: %v", reg.Requests())
	}
}

func TestPushIsReproducible(t *testing.T) {
	reg := startRegistry(t)
	dir := t.TempDir()
	im := pauseImage(t, dir, reg.Host)
	push := func(tag string) v1.Hash {
		t.Helper()
		im := im
		im.Ref = reg.Host + "/pause:" + tag
		d, err := im.Push(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	a, b := push("a"), push("b")
	if a != b {
		t.Errorf("digests of two pushes differ: %v, %v", a, b)
	}

	// A rebuilt binary must not change the digest either.
	if _, err := BuildPause(t.Context(), dir); err != nil {
		t.Fatal(err)
	}
	if c := push("c"); c != a {
		t.Errorf("digest after rebuilding pause = %v, want %v", c, a)
	}

	im.Files[1].Data = []byte("changed\n")
	if d := push("d"); d == a {
		t.Errorf("digest = %v after a file changed, want a new one", d)
	}
}

func TestPushMissingSource(t *testing.T) {
	reg := startRegistry(t)
	im := Image{Ref: reg.Host + "/pause:e2e", Files: []File{{Path: "/pause", Source: filepath.Join(t.TempDir(), "missing")}}}
	_, err := im.Push(t.Context())
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Push = %v, want a not-exist error", err)
	}
	if reqs := reg.Requests(); len(reqs) != 0 {
		t.Errorf("the registry was asked %v, want nothing", reqs)
	}
}

func TestValidate(t *testing.T) {
	file := File{Path: "/pause", Data: []byte("x")}
	tests := []struct {
		name    string
		give    Image
		wantErr []string // substrings; none means valid
	}{
		{name: "valid", give: Image{Ref: testRef, Files: []File{file}}},
		{name: "docker.io with path", give: Image{Ref: "docker.io/multireg/pause:e2e"}},
		{name: "localhost registry", give: Image{Ref: "localhost:5000/pause:e2e"}},
		{name: "loopback registry", give: Image{Ref: "127.0.0.1:5000/pause:e2e"}},
		{name: "nested files", give: Image{Ref: testRef, Files: []File{{Path: "/a/b"}, {Path: "/a/c/d"}}}},
		{name: "short name", give: Image{Ref: "pause:e2e"},
			wantErr: []string{`ref: "pause:e2e": must be normalized, as "docker.io/library/pause:e2e"`}},
		{name: "docker.io without path", give: Image{Ref: "docker.io/pause:e2e"},
			wantErr: []string{`must be normalized, as "docker.io/library/pause:e2e"`}},
		{name: "no tag", give: Image{Ref: "multireg.test/pause"}, wantErr: []string{"ref: \"multireg.test/pause\": must have a tag"}},
		{name: "digest", give: Image{Ref: "multireg.test/pause:e2e@sha256:" + strings.Repeat("a", 64)},
			wantErr: []string{"must not have a digest"}},
		{name: "bad ref", give: Image{Ref: "Multireg.test/Pause:e2e"}, wantErr: []string{"ref: "}},
		{name: "relative path", give: Image{Ref: testRef, Files: []File{{Path: "pause"}}},
			wantErr: []string{`files[0].path: "pause": must be an absolute, clean file path`}},
		{name: "unclean path", give: Image{Ref: testRef, Files: []File{{Path: "/a/../pause"}}},
			wantErr: []string{`files[0].path: "/a/../pause"`}},
		{name: "root", give: Image{Ref: testRef, Files: []File{{Path: "/"}}}, wantErr: []string{`files[0].path: "/"`}},
		{name: "repeated path", give: Image{Ref: testRef, Files: []File{file, file}},
			wantErr: []string{`files[1].path: "/pause": repeats files[0]`}},
		{name: "file as directory", give: Image{Ref: testRef, Files: []File{file, {Path: "/pause/x"}}},
			wantErr: []string{`files[1].path: "/pause/x": files[0] is a file, not a directory`}},
		{name: "source and data", give: Image{Ref: testRef, Files: []File{{Path: "/x", Source: "/bin/sh", Data: []byte("x")}}},
			wantErr: []string{"files[0]: \"/x\": set source or data, not both"}},
		{name: "setuid", give: Image{Ref: testRef, Files: []File{{Path: "/x", Mode: 0o755 | os.ModeSetuid}}},
			wantErr: []string{"files[0].mode: "}},
		{name: "every problem at once", give: Image{Ref: "pause", Files: []File{{Path: "x"}, {Path: "/y", Mode: os.ModeDir}}},
			wantErr: []string{"ref: ", "files[0].path", "files[1].mode"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.give.Validate()
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Errorf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want errors containing %q", tt.wantErr)
			}
			for _, want := range tt.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Validate() = %v, want it to contain %q", err, want)
				}
			}
		})
	}
}
