package manifests

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// versionRepo is a git repository in a temporary directory holding the version's sources —
// hack/version.sh, the Makefile and a VERSION file — committed once.
type versionRepo struct {
	t   *testing.T
	dir string
}

func newVersionRepo(t *testing.T, version string) *versionRepo {
	t.Helper()
	r := &versionRepo{t: t, dir: t.TempDir()}
	if err := os.MkdirAll(filepath.Join(r.dir, "hack"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"hack/version.sh", "Makefile"} {
		b := readRepoFile(t, f)
		if err := os.WriteFile(filepath.Join(r.dir, f), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	r.write("VERSION", version+"\n")
	r.git("init", "-q")
	r.git("add", ".")
	r.git("commit", "-q", "-m", "one")
	return r
}

func (r *versionRepo) write(name, content string) {
	r.t.Helper()
	if err := os.WriteFile(filepath.Join(r.dir, name), []byte(content), 0o644); err != nil {
		r.t.Fatal(err)
	}
}

// git runs git in the repository, with no configuration of this machine's, and returns its
// output.
func (r *versionRepo) git(args ...string) string {
	r.t.Helper()
	cmd := exec.Command("git", append([]string{"-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"}, args...)...)
	cmd.Dir = r.dir
	cmd.Env = append(os.Environ(), "GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		r.t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// run runs a command in the repository with env added, and returns its output and error.
func (r *versionRepo) run(env []string, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.Dir = r.dir
	// Not the make that runs these tests (make manifests): its flags and level would print
	// directories and pass its variables.
	cmd.Env = append(os.Environ(), "GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1", "RELEASE=", "MAKEFLAGS=", "MFLAGS=", "MAKELEVEL=")
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// says is what hack/version.sh prints for what (version, commit, revision).
func (r *versionRepo) says(env []string, what string) string {
	r.t.Helper()
	out, err := r.run(env, "hack/version.sh", what)
	if err != nil {
		r.t.Fatalf("hack/version.sh %s: %v\n%s", what, err, out)
	}
	return out
}

// TestVersionScript: a build of a commit that is not the release's tag says it is a
// pre-release of VERSION, with its commit as build metadata (and -dirty); the release's tag,
// or RELEASE=1, says VERSION. The Makefile stamps the same, and tags the image with the + made a
// dot.
func TestVersionScript(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	r := newVersionRepo(t, "v1.2.0")
	short, full := r.git("rev-parse", "--short", "HEAD"), r.git("rev-parse", "HEAD")

	check := func(name string, env []string, want string) {
		t.Helper()
		if got := r.says(env, "version"); got != want {
			t.Errorf("%s: hack/version.sh says %q; want %q", name, got, want)
		}
	}
	check("a commit without a tag", nil, "v1.2.0-dev+"+short)
	if got := r.says(nil, "commit"); got != short {
		t.Errorf("hack/version.sh commit %q; want %q", got, short)
	}
	if got := r.says(nil, "revision"); got != full {
		t.Errorf("hack/version.sh revision %q; want %q", got, full)
	}
	if out, err := r.run(nil, "make", "-s", "--no-print-directory", "version", "image-tag"); err != nil || out != "v1.2.0-dev+"+short+"\nv1.2.0-dev."+short {
		t.Errorf("make version image-tag: %q (%v); want v1.2.0-dev+%s and the tag v1.2.0-dev.%s", out, err, short, short)
	}
	check("RELEASE=1", []string{"RELEASE=1"}, "v1.2.0")

	r.write("untracked", "x")
	check("an untracked file", nil, "v1.2.0-dev+"+short)
	r.write("VERSION", "v1.2.0\n\n")
	check("a changed tracked file", nil, "v1.2.0-dev+"+short+"-dirty")
	if got := r.says(nil, "commit"); got != short+"-dirty" {
		t.Errorf("hack/version.sh commit %q; want %s-dirty", got, short)
	}
	if got := r.says(nil, "revision"); got != full+"-dirty" {
		t.Errorf("hack/version.sh revision %q; want %s-dirty", got, full)
	}
	if out, err := r.run([]string{"RELEASE=1"}, "hack/version.sh"); err == nil {
		t.Errorf("RELEASE=1 with a changed tracked file: %q; want an error", out)
	}
	if out, err := r.run(nil, "make", "-s", "--no-print-directory", "version", "RELEASE=1"); err == nil {
		t.Errorf("make version RELEASE=1 with a changed tracked file: %q; want an error", out)
	}
	r.write("VERSION", "v1.2.0\n")

	r.git("tag", "v1.1.0")
	check("another release's tag", nil, "v1.2.0-dev+"+short)
	r.git("tag", "-a", "-m", "v1.2.0", "v1.2.0")
	check("the release's tag", nil, "v1.2.0")
	if out, err := r.run(nil, "make", "-s", "--no-print-directory", "version", "image-tag"); err != nil || out != "v1.2.0\nv1.2.0" {
		t.Errorf("make version image-tag on the release's tag: %q (%v); want v1.2.0 twice", out, err)
	}
	r.write("VERSION", "v1.2.0\n\n")
	check("the release's tag, changed", nil, "v1.2.0+"+short+"-dirty")
	r.write("VERSION", "v1.2.0\n")

	r.write("next", "x")
	r.git("add", "next")
	r.git("commit", "-q", "-m", "two")
	check("the commit after the release's", nil, "v1.2.0-dev+"+r.git("rev-parse", "--short", "HEAD"))

	if err := os.RemoveAll(filepath.Join(r.dir, ".git")); err != nil {
		t.Fatal(err)
	}
	check("no git", []string{"GIT_CEILING_DIRECTORIES=" + filepath.Dir(r.dir)}, "v1.2.0-dev+unknown")
	if got := r.says([]string{"GIT_CEILING_DIRECTORIES=" + filepath.Dir(r.dir)}, "commit"); got != "unknown" {
		t.Errorf("no git: hack/version.sh commit %q; want unknown", got)
	}
	check("no git, RELEASE=1", []string{"RELEASE=1", "GIT_CEILING_DIRECTORIES=" + filepath.Dir(r.dir)}, "v1.2.0")
}
