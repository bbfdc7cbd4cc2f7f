package images

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// PausePackage is the import path of the sandbox program that BuildPause builds.
const PausePackage = "multireg.dev/multireg/e2e/node/cmd/pause"

// PauseName is the name and tag of the pause image PushPause pushes, below the registry's host:
// the sandbox image of the test clusters.
const PauseName = "pause:e2e"

// PushPause builds the pause program into dir and pushes its image to the registry at host
// (HOST:PORT, plain HTTP) as HOST/PauseName, the reference it returns.
func PushPause(ctx context.Context, dir, host string) (string, error) {
	bin, err := BuildPause(ctx, dir)
	if err != nil {
		return "", err
	}
	im := Image{Ref: host + "/" + PauseName, Files: []File{{Path: "/pause", Source: bin, Mode: 0o755}}, Entrypoint: []string{"/pause"}}
	if _, err := im.Push(ctx); err != nil {
		return "", err
	}
	return im.Ref, nil
}

// BuildPause builds PausePackage into outDir/pause and returns that path. The binary is
// static (CGO_ENABLED=0), linux/runtime.GOARCH, stripped and reproducible (-trimpath,
// -buildvcs=false), so images holding it keep their digest across builds. It needs the go
// command in PATH (go test puts its own first) and runs it inside this module.
func BuildPause(ctx context.Context, outDir string) (string, error) {
	out := filepath.Join(outDir, "pause")
	if err := goBuild(ctx, PausePackage, out); err != nil {
		return "", err
	}
	return out, nil
}

// goBuild builds the package pkg of this module into the static binary out.
func goBuild(ctx context.Context, pkg, out string) error {
	out, err := filepath.Abs(out)
	if err != nil {
		return fmt.Errorf("go build %s: %w", pkg, err)
	}
	cmd := exec.CommandContext(ctx, "go", "build",
		"-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", out, pkg)
	cmd.Dir = moduleDir()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
	var output bytes.Buffer
	cmd.Stdout, cmd.Stderr = &output, &output
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s: %w: %s", pkg, err, bytes.TrimSpace(output.Bytes()))
	}
	return nil
}

// moduleDir returns a directory inside this module: this file's directory when the source
// is on disk, else "" (the working directory, which go test sets to the package under test).
func moduleDir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(file) {
		return ""
	}
	dir := filepath.Dir(file)
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return ""
	}
	return dir
}
