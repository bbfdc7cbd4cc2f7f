package manifests

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// The build script of every shipped binary, and the version and commit it stamps in tests.
const (
	buildScript = "hack/build-binary.sh"
	testVersion = "v0.0.0-manifests-test"
	testCommit  = "0123abc"
)

// buildDir holds what the tests build; TestMain removes it.
var buildDir = sync.OnceValues(func() (string, error) { return os.MkdirTemp("", "manifests") })

// multiregBinary builds multireg once, the way the image's binaries are built: the build
// script, for this machine's platform.
var multiregBinary = sync.OnceValues(func() (string, error) {
	root := filepath.Join(filepath.Dir(callerFile()), "..", "..")
	dir, err := buildDir()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "multireg")
	cmd := exec.Command(filepath.Join(root, buildScript), bin)
	cmd.Env = append(os.Environ(), "GOOS="+runtime.GOOS, "GOARCH="+runtime.GOARCH, "VERSION="+testVersion, "COMMIT="+testCommit)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", &buildError{err: err, out: out}
	}
	return bin, nil
})

type buildError struct {
	err error
	out []byte
}

func (e *buildError) Error() string { return buildScript + ": " + e.err.Error() + "\n" + string(e.out) }

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
	// Static: the image has nothing but the binary and its license, so no dynamic loader
	// (PT_INTERP) and no shared library.
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary is dynamically linked; the image has no libc")
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("the binary needs shared libraries %q (%v); the image has none", libs, err)
	}
}

// Without VERSION and COMMIT, the build script stamps what hack/version.sh says of the
// checkout: a binary built by hand says which release it leads to and its commit
// (v0.2.0-dev+9b9233c), or, on the release's tag, the release.
func TestBuildScriptStampsTheVersionFile(t *testing.T) {
	root := repoRoot(t)
	says := func(what string) string {
		t.Helper()
		cmd := exec.Command(filepath.Join(root, "hack", "version.sh"), what)
		cmd.Env = append(os.Environ(), "RELEASE=")
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("hack/version.sh %s: %v", what, err)
		}
		return strings.TrimSpace(string(out))
	}
	version, commit := says("version"), says("commit")
	file := strings.TrimSpace(string(readRepoFile(t, "VERSION")))
	if version != file && !strings.HasPrefix(version, file+"-dev+") && !strings.HasPrefix(version, file+"+") {
		t.Errorf("hack/version.sh says %q; want the VERSION file's %s, or a build of it", version, file)
	}
	dir, err := buildDir()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "multireg-version-file")
	cmd := exec.Command(filepath.Join(root, buildScript), bin)
	cmd.Env = append(os.Environ(), "VERSION=", "COMMIT=", "RELEASE=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", buildScript, err, out)
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("multireg version: %v\n%s", err, out)
	}
	if want := "multireg " + version + " (commit " + commit + ","; !strings.HasPrefix(string(out), want) {
		t.Errorf("multireg version = %q; want it to start with %q", out, want)
	}
}
