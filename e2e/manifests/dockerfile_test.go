package manifests

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// The build script the Dockerfile's build stage must run, and the version it stamps in tests.
const (
	buildScript  = "hack/build-binary.sh"
	testVersion  = "v0.0.0-manifests-test"
	testCommit   = "0123abc"
	finalBinary  = "/multireg"
	distroless   = "gcr.io/distroless/static"
	buildStageAs = "build"
)

// dockerfile is the parsed Dockerfile: BuildKit's own parser and instruction parser, with the
// checks BuildKit runs while parsing reported as warnings.
type dockerfile struct {
	stages   []instructions.Stage
	metaArgs []instructions.ArgCommand
	warnings []string
}

func parseDockerfile(b []byte) (*dockerfile, error) {
	res, err := parser.Parse(bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	d := &dockerfile{}
	for _, w := range res.Warnings {
		d.warnings = append(d.warnings, fmt.Sprintf("%s: %s", w.Short, bytes.Join(w.Detail, []byte(" "))))
	}
	lint := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		d.warnings = append(d.warnings, fmt.Sprintf("line %d: %s: %s", line, rule, msg))
	}})
	d.stages, d.metaArgs, err = instructions.Parse(res.AST, lint)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// argDefault returns the default of a global ARG (declared before the first FROM).
func (d *dockerfile) argDefault(name string) string {
	for _, a := range d.metaArgs {
		for _, kv := range a.Args {
			if kv.Key == name && kv.Value != nil {
				return *kv.Value
			}
		}
	}
	return ""
}

// buildCommand returns the shell command of the build stage that runs the build script.
func (d *dockerfile) buildCommand() (string, error) {
	for _, s := range d.stages {
		if s.Name != buildStageAs {
			continue
		}
		for _, c := range s.Commands {
			if run, ok := c.(*instructions.RunCommand); ok && strings.Contains(strings.Join(run.CmdLine, " "), buildScript) {
				if !run.PrependShell {
					return "", errors.New("the build command must be in shell form, to expand its variables")
				}
				return strings.Join(run.CmdLine, " "), nil
			}
		}
	}
	return "", fmt.Errorf("no RUN %s in a stage named %q", buildScript, buildStageAs)
}

// binaryCopy returns the source path of the final stage's COPY --from=build of the binary.
func (d *dockerfile) binaryCopy() (string, error) {
	final := d.stages[len(d.stages)-1]
	for _, c := range final.Commands {
		if cp, ok := c.(*instructions.CopyCommand); ok && cp.From == buildStageAs && cp.DestPath == finalBinary && len(cp.SourcePaths) == 1 {
			return cp.SourcePaths[0], nil
		}
	}
	return "", fmt.Errorf("the final stage has no COPY --from=%s <binary> %s", buildStageAs, finalBinary)
}

func TestDockerfile(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	d, err := parseDockerfile(b)
	if err != nil {
		t.Fatalf("BuildKit cannot parse the Dockerfile: %v", err)
	}
	if len(d.warnings) > 0 {
		t.Errorf("BuildKit's checks warn:\n%s", strings.Join(d.warnings, "\n"))
	}
	if len(d.stages) != 2 {
		t.Fatalf("%d stages; want 2 (build, final)", len(d.stages))
	}
	build, final := d.stages[0], d.stages[1]
	labels := map[string]string{}
	var entrypoint []string
	var entrypointShell bool
	var user string
	for _, c := range final.Commands {
		switch c := c.(type) {
		case *instructions.LabelCommand:
			for _, kv := range c.Labels {
				labels[kv.Key] = kv.Value
			}
		case *instructions.EntrypointCommand:
			entrypoint, entrypointShell = c.CmdLine, c.PrependShell
		case *instructions.UserCommand:
			user = c.User
		}
	}
	cmd, cmdErr := d.buildCommand()
	src, srcErr := d.binaryCopy()

	checks := []struct {
		name string
		ok   bool
		msg  string
	}{
		{"build stage is named build", build.Name == buildStageAs, fmt.Sprintf("first stage is %q", build.Name)},
		{"build stage is golang", strings.HasPrefix(build.BaseName, "golang:"), build.BaseName},
		{"build stage cross-compiles on the build platform", build.Platform == "$BUILDPLATFORM", build.Platform},
		{"build stage runs " + buildScript, cmdErr == nil, fmt.Sprint(cmdErr)},
		{"build command cross-compiles for the target", strings.Contains(cmd, "GOOS=$TARGETOS") && strings.Contains(cmd, "GOARCH=$TARGETARCH"), cmd},
		{"build command stamps VERSION and COMMIT", strings.Contains(cmd, "VERSION=$VERSION") && strings.Contains(cmd, "COMMIT=$COMMIT"), cmd},
		{"final stage copies the built binary", srcErr == nil && strings.Contains(cmd, src), fmt.Sprintf("%v; build command %q", srcErr, cmd)},
		{"final stage is distroless/static", strings.HasPrefix(d.argDefault(strings.Trim(final.BaseName, "${}")), distroless), fmt.Sprintf("FROM %s (default %q)", final.BaseName, d.argDefault(strings.Trim(final.BaseName, "${}")))},
		{"final stage runs as root", user == "0:0" || user == "0" || user == "root", fmt.Sprintf("USER %q", user)},
		{"entrypoint is the binary, exec form", !entrypointShell && slices.Equal(entrypoint, []string{finalBinary}), fmt.Sprintf("ENTRYPOINT %q (shell form: %v)", entrypoint, entrypointShell)},
	}
	for _, l := range []string{"title", "description", "version", "revision"} {
		key := "org.opencontainers.image." + l
		checks = append(checks, struct {
			name string
			ok   bool
			msg  string
		}{"label " + key, labels[key] != "", fmt.Sprintf("labels: %v", labels)})
	}
	for _, c := range checks {
		if !c.ok {
			t.Errorf("%s: %s", c.name, c.msg)
		}
	}
}

func TestDockerfileChecksFail(t *testing.T) {
	tests := []struct {
		name    string
		give    string
		wantErr string
		warning string
	}{
		{"unknown instruction", "FROM scratch\nRUNN true\n", "unknown instruction", ""},
		{"stage name casing", "FROM golang AS Build\nFROM scratch\n", "", "StageNameCasing"},
		{"no build script", "FROM golang AS build\nRUN go build\nFROM scratch\n", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := parseDockerfile([]byte(tt.give))
			if tt.wantErr != "" {
				checkErr(t, err, tt.wantErr)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.warning != "" {
				if !strings.Contains(strings.Join(d.warnings, "\n"), tt.warning) {
					t.Fatalf("warnings %q lack %s", d.warnings, tt.warning)
				}
				return
			}
			if _, err := d.buildCommand(); err == nil {
				t.Fatal("buildCommand found a build command that is not there")
			}
		})
	}
}

// contextFiles returns the files of root that a Docker build context holds: those that
// .dockerignore does not exclude, as paths relative to root.
func contextFiles(root string) ([]string, error) {
	f, err := os.Open(filepath.Join(root, ".dockerignore"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		return nil, err
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		return nil, err
	}
	var files []string
	err = filepath.WalkDir(root, func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil || rel == "." {
			return err
		}
		excluded, err := pm.MatchesOrParentMatches(filepath.ToSlash(rel))
		if err != nil {
			return err
		}
		// A directory's files may be re-included by a "!" pattern: only prune without any.
		if e.IsDir() && excluded && !pm.Exclusions() {
			return filepath.SkipDir
		}
		if !e.IsDir() && !excluded {
			files = append(files, rel)
		}
		return nil
	})
	return files, err
}

// copyFiles copies files (relative paths) from src to dst, keeping their modes.
func copyFiles(src, dst string, files []string) error {
	for _, rel := range files {
		info, err := os.Lstat(filepath.Join(src, rel))
		if err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			return fmt.Errorf("%s: not a regular file", rel)
		}
		b, err := os.ReadFile(filepath.Join(src, rel))
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(dst, filepath.Dir(rel)), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dst, rel), b, info.Mode().Perm()); err != nil {
			return err
		}
	}
	return nil
}

// buildDir holds what the tests build; TestMain removes it.
var buildDir = sync.OnceValues(func() (string, error) { return os.MkdirTemp("", "manifests") })

// multiregBinary builds multireg once, the way the image does: the Dockerfile's own build
// command, run in a copy of the Docker build context (the repository minus .dockerignore), for
// this machine's platform. A package missing from the context fails here, not in a release.
var multiregBinary = sync.OnceValues(func() (string, error) {
	root := filepath.Join(filepath.Dir(callerFile()), "..", "..")
	b, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		return "", err
	}
	d, err := parseDockerfile(b)
	if err != nil {
		return "", err
	}
	cmd, err := d.buildCommand()
	if err != nil {
		return "", err
	}
	src, err := d.binaryCopy()
	if err != nil {
		return "", err
	}
	dir, err := buildDir()
	if err != nil {
		return "", err
	}
	ctx := filepath.Join(dir, "context")
	files, err := contextFiles(root)
	if err != nil {
		return "", fmt.Errorf("docker build context: %w", err)
	}
	if err := copyFiles(root, ctx, files); err != nil {
		return "", fmt.Errorf("docker build context: %w", err)
	}
	bin := filepath.Join(dir, "multireg")
	sh := exec.Command("/bin/sh", "-c", strings.ReplaceAll(cmd, src, bin))
	sh.Dir = ctx
	sh.Env = append(os.Environ(),
		"TARGETOS="+runtime.GOOS, "TARGETARCH="+runtime.GOARCH,
		"VERSION="+testVersion, "COMMIT="+testCommit)
	if out, err := sh.CombinedOutput(); err != nil {
		return "", fmt.Errorf("the Dockerfile's build command %q in the build context (%d files, .dockerignore applied): %v\n%s", cmd, len(files), err, out)
	}
	return bin, nil
})

func callerFile() string {
	_, file, _, _ := runtime.Caller(0)
	return file
}

func TestMain(m *testing.M) {
	code := m.Run()
	if dir, err := buildDir(); err == nil {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// binary returns the multireg binary, or fails the test.
func binary(t testing.TB) string {
	t.Helper()
	bin, err := multiregBinary()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func TestImageBinary(t *testing.T) {
	bin := binary(t)
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("multireg version: %v\n%s", err, out)
	}
	for _, want := range []string{testVersion, testCommit} {
		if !strings.Contains(string(out), want) {
			t.Errorf("multireg version = %q; want it to contain %q (stamped by %s)", out, want, buildScript)
		}
	}
	// Static: the image has no libc, so no dynamic loader (PT_INTERP) and no shared library.
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary is dynamically linked; the distroless/static image has no libc")
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("the binary needs shared libraries %q (%v); the image has none", libs, err)
	}
}

func TestDockerContext(t *testing.T) {
	files, err := contextFiles(repoRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path string
		want bool
	}{
		{"go.mod", true},
		{"go.sum", true},
		{"cmd/multireg/main.go", true},
		{buildScript, true},
		{"hack/measure-rss.sh", false},
		{"cmd/multireg/main_test.go", false},
		{"e2e/go.mod", false},
		{"examples/daemonset.yaml", false},
		{"charts/multireg/Chart.yaml", false},
		{"README.md", false},
	}
	for _, tt := range tests {
		if got := slices.Contains(files, filepath.FromSlash(tt.path)); got != tt.want {
			t.Errorf("%s in the build context: %v; want %v", tt.path, got, tt.want)
		}
	}
	for _, f := range files {
		if strings.HasPrefix(f, ".git"+string(filepath.Separator)) || strings.HasPrefix(f, "bin"+string(filepath.Separator)) {
			t.Errorf("%s is in the build context", f)
		}
	}
}
