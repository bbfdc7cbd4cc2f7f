package main

import (
	"archive/tar"
	"bytes"
	"io"
	"maps"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// dockerfileLike builds what a Dockerfile builder makes of the same files as hack/image: its
// own tar (a root entry, ./-prefixed names, another order), each file in a layer of its own,
// a history entry per instruction; the config as given.
func dockerfileLike(t *testing.T, files []tar.Header, data map[string][]byte, cfg v1.Config, created time.Time) v1.Image {
	t.Helper()
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	for i, h := range files {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		if i == 0 {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "./", Mode: 0o755, ModTime: created}); err != nil {
				t.Fatal(err)
			}
		}
		h := h
		h.Name = "./" + h.Name
		h.Size = int64(len(data[strings.TrimPrefix(h.Name, "./")]))
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data[strings.TrimPrefix(h.Name, "./")]); err != nil {
			t.Fatal(err)
		}
		if err := tw.Close(); err != nil {
			t.Fatal(err)
		}
		b := buf.Bytes()
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }, tarball.WithMediaType(types.OCILayer))
		if err != nil {
			t.Fatal(err)
		}
		if img, err = mutate.Append(img, mutate.Addendum{Layer: l, History: v1.History{CreatedBy: "COPY " + h.Name}}); err != nil {
			t.Fatal(err)
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Created = v1.Time{Time: created}
	cf.Config = cfg
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// compare finds every difference between hack/image's image and another image, file by file
// and config field by config field, and none where the two differ only in how the files are
// cut into layers and described.
func TestCompare(t *testing.T) {
	s := testSpec(t)
	s.platforms = []string{"linux/amd64"}
	idx := mustIndex(t, s)
	dir := filepath.Join(t.TempDir(), "layout")
	if _, err := layout.Write(dir, empty.Index); err != nil {
		t.Fatal(err)
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendIndex(idx); err != nil {
		t.Fatal(err)
	}
	ours, err := imageIn(dir, "linux/amd64")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := imageIn(dir, "linux/arm64"); err == nil || !strings.Contains(err.Error(), "0 images for linux/arm64") {
		t.Errorf("imageIn linux/arm64: %v; want none found", err)
	}
	cfg, err := ours.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	bin := append(fakeELF(t, "amd64", false), "linux/amd64"...)
	data := map[string][]byte{"multireg": bin, "LICENSE": []byte("Apache License\n"), agentName: append(bytes.Clone(bin), "agent"...)}
	headers := func() []tar.Header {
		return []tar.Header{
			{Typeflag: tar.TypeReg, Name: "multireg", Mode: 0o755, ModTime: testCreated},
			{Typeflag: tar.TypeReg, Name: "LICENSE", Mode: 0o644, ModTime: testCreated},
			{Typeflag: tar.TypeReg, Name: agentName, Mode: 0o755, ModTime: testCreated},
		}
	}
	config := func() v1.Config { return *cfg.Config.DeepCopy() }

	tests := []struct {
		name   string
		change func(h []tar.Header, d map[string][]byte, c *v1.Config, created *time.Time)
		want   []string // each a difference's beginning; none: the same
	}{
		{"the same files and config, cut and described otherwise", func([]tar.Header, map[string][]byte, *v1.Config, *time.Time) {}, nil},
		{"a binary's byte", func(_ []tar.Header, d map[string][]byte, _ *v1.Config, _ *time.Time) {
			d["multireg"] = append(bytes.Clone(bin[:len(bin)-1]), 'x')
		}, []string{"/multireg: a file 0755 0:0"}},
		{"a mode", func(h []tar.Header, _ map[string][]byte, _ *v1.Config, _ *time.Time) { h[1].Mode = 0o664 }, []string{"/LICENSE: a file 0644"}},
		{"an owner", func(h []tar.Header, _ map[string][]byte, _ *v1.Config, _ *time.Time) { h[0].Uid = 65532 }, []string{"/multireg: a file 0755 0:0"}},
		{"a file's time", func(h []tar.Header, _ map[string][]byte, _ *v1.Config, _ *time.Time) {
			h[0].ModTime = testCreated.Add(time.Second)
		}, []string{"/multireg: a file"}},
		{"another file", func(h []tar.Header, d map[string][]byte, _ *v1.Config, _ *time.Time) {
			h[1] = tar.Header{Typeflag: tar.TypeReg, Name: "etc/passwd", Mode: 0o644, ModTime: testCreated}
			d["etc/passwd"] = []byte("root:x:0:0::/:\n")
		}, []string{"/LICENSE: only in a", "/etc/passwd: only in b"}},
		{"an env", func(_ []tar.Header, _ map[string][]byte, c *v1.Config, _ *time.Time) {
			c.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
		}, []string{"config.Env: a []string(nil)"}},
		{"a label", func(_ []tar.Header, _ map[string][]byte, c *v1.Config, _ *time.Time) {
			c.Labels["io.buildah.version"] = "1.28.2"
		}, []string{"config.Labels:"}},
		{"the user", func(_ []tar.Header, _ map[string][]byte, c *v1.Config, _ *time.Time) { c.User = "" }, []string{`config.User: a "0:0"; b ""`}},
		{"a cmd", func(_ []tar.Header, _ map[string][]byte, c *v1.Config, _ *time.Time) { c.Cmd = []string{"run"} }, []string{"config.Cmd:"}},
		{"a working directory", func(_ []tar.Header, _ map[string][]byte, c *v1.Config, _ *time.Time) { c.WorkingDir = "/src" }, []string{"config.WorkingDir:"}},
		{"the creation time", func(_ []tar.Header, _ map[string][]byte, _ *v1.Config, created *time.Time) {
			*created = testCreated.Add(time.Hour)
		}, []string{`created: a "2026-11-27T03:00:00Z"; b "2026-11-27T04:00:00Z"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, d, c, created := headers(), maps.Clone(data), config(), testCreated
			tt.change(h, d, &c, &created)
			other := dockerfileLike(t, h, d, c, created)
			diffs, compared, err := compareImages(ours, other)
			if err != nil {
				t.Fatal(err)
			}
			if len(diffs) != len(tt.want) {
				t.Fatalf("differences %q; want %d, beginning %q", diffs, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.HasPrefix(diffs[i], w) {
					t.Errorf("difference %d %q; want it to begin %q", i, diffs[i], w)
				}
			}
			if tt.want == nil && !strings.Contains(compared, "3 files (/LICENSE, /multireg, /multireg-nodecond)") {
				t.Errorf("compared %q; want the three files named", compared)
			}
		})
	}
}
