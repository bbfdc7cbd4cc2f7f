package doccmd

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// The environment of this test binary run as the child of TestUnderParentMake: the stand-in
// repository to run the README's commands in, and the file to write what they gave to.
const (
	childRepoEnv   = "DOCCMD_TEST_CHILD_REPO"
	childResultEnv = "DOCCMD_TEST_CHILD_RESULT"
	childBinEnv    = "DOCCMD_TEST_BIN"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(childRepoEnv); dir != "" {
		os.Exit(child(dir, os.Getenv(childResultEnv)))
	}
	os.Exit(m.Run())
}

// stubRepo is the repository's Makefile as far as the README's install sees it: image-push
// prints what its recipe sees of make's variables, then, last, IMAGE:TAG@sha256:DIGEST, as the
// real one does; image-tag prints the tag. RELEASE=1 makes the tag a release's (hack/version.sh).
const stubRepo = `RELEASE ?=
TAG := $(if $(filter 1,$(RELEASE)),v0.9.0,v0.9.0-dev.abc1234)

image-push:
	@test -n "$(IMAGE)" || { echo "usage: make image-push IMAGE=REGISTRY/NAME" >&2; exit 2; }
	@echo "the recipe sees: MAKELEVEL=$$MAKELEVEL KUBE=$(KUBE) NODE_ARGS=$(NODE_ARGS) RELEASE=$(RELEASE)"
	cd . && echo $(IMAGE):$(TAG)@sha256:` + digest + `

image-tag:
	@echo $(TAG)
`

const (
	digest = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	repo   = "registry.example.com/you/multireg"
)

// The parent makes, as the nightly run nests them: the repository's make e2e-node-helm runs
// e2e/node's make, whose recipe runs the test binary.
const (
	stubOuter = "e2e-node-helm:\n\t$(MAKE) -C node helm\n"
	stubNode  = "helm:\n\t\"$$" + childBinEnv + "\" -test.run='^$$'\n"
)

// childResult is what the child saw and what the README's commands gave it.
type childResult struct {
	MakeLevel, MakeFlags string // the child's own environment: proof that make runs it
	PushOut, PushErr     string // make image-push IMAGE=repo
	Pushed, ParseErr     string // PushedImage of its output
	Tag, TagErr          string // $(make -s image-tag)
}

// child runs the README's install commands, as TestHelmInstall runs them, in dir, and writes
// what they gave to result.
func child(dir, result string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r := childResult{MakeLevel: os.Getenv("MAKELEVEL"), MakeFlags: os.Getenv("MAKEFLAGS")}
	out, err := Make(ctx, dir, "image-push", "IMAGE="+repo).CombinedOutput()
	r.PushOut = string(out)
	if err != nil {
		r.PushErr = err.Error()
	}
	if r.Pushed, err = PushedImage(r.PushOut, repo); err != nil {
		r.ParseErr = err.Error()
	}
	tag, err := Shell(ctx, dir, "make -s image-tag").Output()
	r.Tag = string(tag)
	if err != nil {
		r.TagErr = err.Error()
	}
	b, err := json.Marshal(r)
	if err == nil {
		err = os.WriteFile(result, b, 0o644)
	}
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		return 1
	}
	return 0
}

// TestUnderParentMake runs the README's `make image-push IMAGE=…` and `$(make -s image-tag)`
// through Make and Shell from a process that two makes started, with variables on the outer
// one's command line (`make e2e-node-helm KUBE=1.37 NODE_ARGS='…' RELEASE=1`), against a
// stand-in of the repository's Makefile: the child make prints no directory line, sees none of
// the parents' variables (RELEASE=1 would make its tag a release's), and the pushed reference
// is found although it is not the last line a sub-make would print.
func TestUnderParentMake(t *testing.T) {
	dir := t.TempDir()
	stubs := map[string]string{"repo/Makefile": stubRepo, "outer/Makefile": stubOuter, "outer/node/Makefile": stubNode}
	for name, text := range stubs {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	result := filepath.Join(dir, "result.json")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// The outer make starts clean, as a user's does, whether or not make runs this test.
	outer := exec.CommandContext(ctx, "make", "-C", filepath.Join(dir, "outer"), "e2e-node-helm",
		"KUBE=1.37", "NODE_ARGS=-test.run=TestHelmInstall -helm", "RELEASE=1")
	outer.Env = append(Environ(os.Environ()), childBinEnv+"="+self, childRepoEnv+"="+filepath.Join(dir, "repo"), childResultEnv+"="+result)
	if out, err := outer.CombinedOutput(); err != nil {
		t.Fatalf("make e2e-node-helm: %v\n%s", err, out)
	}
	b, err := os.ReadFile(result)
	if err != nil {
		t.Fatal(err)
	}
	var r childResult
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	// Not vacuous: the child ran as a sub-make's recipe, with the outer command line's variables.
	if r.MakeLevel != "2" || !strings.Contains(r.MakeFlags, "KUBE=1.37") || !strings.Contains(r.MakeFlags, `NODE_ARGS=-test.run=TestHelmInstall\ -helm`) {
		t.Fatalf("the child's MAKELEVEL=%q MAKEFLAGS=%q: want 2, and the outer make's variables", r.MakeLevel, r.MakeFlags)
	}
	if r.PushErr != "" {
		t.Fatalf("make image-push: %s\n%s", r.PushErr, r.PushOut)
	}
	t.Logf("make image-push printed:\n%s", r.PushOut)
	if strings.Contains(r.PushOut, "Entering directory") || strings.Contains(r.PushOut, "Leaving directory") {
		t.Errorf("make image-push printed make's directory lines, as a sub-make does:\n%s", r.PushOut)
	}
	if want := "the recipe sees: MAKELEVEL=1 KUBE= NODE_ARGS= RELEASE=\n"; !strings.Contains(r.PushOut, want) {
		t.Errorf("make image-push's recipe saw a parent make's variables:\n%s\nwant the line %q", r.PushOut, want)
	}
	if want := repo + ":v0.9.0-dev.abc1234@sha256:" + digest; r.ParseErr != "" || r.Pushed != want {
		t.Errorf("PushedImage: %q, %s; want %s", r.Pushed, r.ParseErr, want)
	}
	if r.TagErr != "" || r.Tag != "v0.9.0-dev.abc1234\n" {
		t.Errorf("$(make -s image-tag): %q, %s; want v0.9.0-dev.abc1234", r.Tag, r.TagErr)
	}
}

func TestEnviron(t *testing.T) {
	env := []string{
		"PATH=/usr/bin",
		"HOME=/root",
		"GO=go1.26",
		"MAKEFLAGS=w -j2 --jobserver-auth=3,4 -- X=1 KUBE=1.37 NODE_ARGS=-test.run=TestHelmInstall\\ -helm Y:=2 Z+=3 W?=4 A\\ B=5 LAST=",
		"MAKELEVEL=2",
		"MFLAGS=-w -j2",
		"MAKEOVERRIDES=${-*-command-variables-*-}",
		"MAKE_TERMOUT=/dev/pts/0",
		"MAKE_TERMERR=/dev/pts/0",
		"MAKEFILES=evil.mk",
		"GNUMAKEFLAGS=-w",
		"X=1", "KUBE=1.37", "NODE_ARGS=-test.run=TestHelmInstall -helm", "Y=2", "Z=3", "W=4", "LAST=",
		"NODE_ARGSX=kept",
	}
	want := []string{"PATH=/usr/bin", "HOME=/root", "GO=go1.26", "NODE_ARGSX=kept"}
	if got := Environ(env); !slices.Equal(got, want) {
		t.Errorf("Environ:\n got %q\nwant %q", got, want)
	}
	// Flags without variables, and variables without flags.
	for _, c := range []struct {
		makeflags string
		want      []string
	}{
		{"w", nil},
		{"", nil},
		{"-- KUBE=1.37", []string{"KUBE"}},
		{" -- KUBE=1.37 TIMEOUT=5m", []string{"KUBE", "TIMEOUT"}},
		{"s -- NODE_ARGS=a\\ b\\\\ c", []string{"NODE_ARGS"}},
		{"k -- V::=1 S!=date", []string{"V", "S"}},
	} {
		if got := commandLineVars(c.makeflags); !slices.Equal(got, c.want) {
			t.Errorf("commandLineVars(%q) = %q, want %q", c.makeflags, got, c.want)
		}
	}
}

func TestPushedImage(t *testing.T) {
	ref := repo + ":v0.2.0-dev.9b9233c@sha256:" + digest
	for _, c := range []struct {
		name, out, want, err string
	}{
		{"last line", "cd hack/image && go run . push -layout bin/image -image " + repo + "\n" + ref + "\n", ref, ""},
		{"a sub-make's directory line last", "make[2]: Entering directory '/src'\n" + ref + "\nmake[2]: Leaving directory '/src'\n", ref, ""},
		{"carriage returns", ref + "\r\n", ref, ""},
		{"printed twice", ref + "\n" + ref + "\n", ref, ""},
		{"nothing", "", "", "printed no line " + repo + ":TAG@sha256:DIGEST; it printed:\n\t(nothing)"},
		{"only the directory line", "make[2]: Leaving directory '/src'\n", "", "it printed:\n\tmake[2]: Leaving directory '/src'"},
		{"another repository", "other.example.com/multireg:v1@sha256:" + digest + "\n", "", "printed no line"},
		{"a repository that ends with it", "registry.example.com/you/multireg2:v1@sha256:" + digest + "\n", "", "printed no line"},
		{"a short digest", repo + ":v1@sha256:0123\n", "", "printed no line"},
		{"no tag", repo + "@sha256:" + digest + "\n", "", "printed no line"},
		{"two tags", ref + "\n" + repo + ":latest@sha256:" + digest + "\n", "", "printed 2 image references, want one"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := PushedImage(c.out, repo)
			if got != c.want {
				t.Errorf("PushedImage = %q, want %q", got, c.want)
			}
			switch {
			case c.err == "" && err != nil:
				t.Errorf("error %v, want none", err)
			case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
				t.Errorf("error %v, want one containing %q", err, c.err)
			}
		})
	}
}
