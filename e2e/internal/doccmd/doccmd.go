// Package doccmd runs the command lines of the docs (the README's install: `make image-push`,
// `$(make -s image-tag)`) as a user's shell runs them, whoever runs the test: a test started
// by make (`make e2e-node`, itself run by `make test-nightly`) inherits make's variables, and a
// make started with them is a sub-make. It prints `make[2]: Entering directory …` and `make[2]:
// Leaving directory …` around its output, takes the parent's flags (-w, -n, -k, -j and its
// jobserver) and the variables set on the parent's command line (KUBE=1.37, NODE_ARGS=…,
// RELEASE=…), which override the Makefile's own. A shell has none of them, and neither have
// the commands run here.
package doccmd

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
)

// makeVars are the variables make puts in the environment of its recipes (and, for
// MAKEFILES, reads: the makefiles every make reads first): MAKEFLAGS holds the parent's flags
// and, after " -- ", its command-line variables; MFLAGS the flags alone; MAKELEVEL how deep
// the sub-make is, which turns on its "Entering directory" lines; MAKE_TERMOUT and
// MAKE_TERMERR say the parent's outputs are terminals.
var makeVars = []string{"MAKEFLAGS", "MFLAGS", "GNUMAKEFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MAKEFILES", "MAKE_TERMOUT", "MAKE_TERMERR"}

// Environ returns env (os.Environ's form, NAME=VALUE) without what a parent make put there:
// make's own variables (makeVars), and each variable set on its command line, which make
// exports to its recipes and names in MAKEFLAGS after " -- " (`make e2e-node KUBE=1.37`: KUBE).
// A variable of the user's own environment stays, as it stays in a shell.
func Environ(env []string) []string {
	drop := map[string]bool{}
	for _, v := range makeVars {
		drop[v] = true
	}
	for _, kv := range env {
		if name, val, _ := strings.Cut(kv, "="); name == "MAKEFLAGS" {
			for _, n := range commandLineVars(val) {
				drop[n] = true
			}
		}
	}
	var out []string
	for _, kv := range env {
		if name, _, _ := strings.Cut(kv, "="); !drop[name] {
			out = append(out, kv)
		}
	}
	return out
}

// commandLineVars returns the names of the variables MAKEFLAGS sets: its words after " -- "
// (GNU make's form: `w -- KUBE=1.37 NODE_ARGS=-test.run=X\ -helm`, a space in a value escaped
// with a backslash), each NAME=VALUE, NAME:=VALUE, NAME::=VALUE, NAME+=VALUE, NAME?=VALUE or
// NAME!=VALUE.
func commandLineVars(makeflags string) []string {
	var rest string
	if strings.HasPrefix(makeflags, "-- ") {
		rest = makeflags[len("-- "):]
	} else if i := strings.Index(makeflags, " -- "); i >= 0 {
		rest = makeflags[i+len(" -- "):]
	} else {
		return nil
	}
	var words []string
	var w strings.Builder
	for i := 0; i < len(rest); i++ {
		switch c := rest[i]; {
		case c == '\\' && i+1 < len(rest):
			i++
			w.WriteByte(rest[i])
		case c == ' ':
			if w.Len() > 0 {
				words = append(words, w.String())
				w.Reset()
			}
		default:
			w.WriteByte(c)
		}
	}
	if w.Len() > 0 {
		words = append(words, w.String())
	}
	var names []string
	for _, word := range words {
		name, _, ok := strings.Cut(word, "=")
		if !ok {
			continue
		}
		name = strings.TrimRight(name, ":+?!")
		if name != "" {
			names = append(names, name)
		}
	}
	return names
}

// Make returns the command `make --no-print-directory ARGS…`, run in dir with the environment
// of this process without a parent make's variables (Environ): what a user who types
// `make ARGS…` in dir gets, whether or not make runs this process. --no-print-directory keeps
// the directory lines out of its output even where a make prints them on its own (-C).
func Make(ctx context.Context, dir string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "make", append([]string{"--no-print-directory"}, args...)...)
	cmd.Dir = dir
	cmd.Env = Environ(os.Environ())
	return cmd
}

// Shell returns the command `sh -c SCRIPT`, run in dir with the environment of Make: a
// command substitution of the docs, `$(make -s image-tag)`, as a user's shell expands it.
func Shell(ctx context.Context, dir, script string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "sh", "-c", script)
	cmd.Dir = dir
	cmd.Env = Environ(os.Environ())
	return cmd
}

// PushedImage returns what `make image-push IMAGE=REPO` says it pushed: the line of out that
// is REPO:TAG@sha256:DIGEST, wherever it is among the lines of the build (make's commands,
// the Go tool's, a parent make's directory lines). An output without such a line, or with
// two different ones, is an error that quotes the output.
func PushedImage(out, repo string) (string, error) {
	re := regexp.MustCompile(`^` + regexp.QuoteMeta(repo) + `:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}@sha256:[0-9a-f]{64}$`)
	var found []string
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimSpace(l)
		if re.MatchString(l) && !slices.Contains(found, l) {
			found = append(found, l)
		}
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		return "", fmt.Errorf("make image-push printed no line %s:TAG@sha256:DIGEST; it printed:\n%s", repo, quote(out))
	default:
		return "", fmt.Errorf("make image-push printed %d image references, want one: %q; it printed:\n%s", len(found), found, quote(out))
	}
}

// quote is out for an error message: its last 40 lines, each indented, or "(nothing)".
func quote(out string) string {
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if strings.TrimSpace(out) == "" {
		return "\t(nothing)"
	}
	if len(lines) > 40 {
		lines = append([]string{fmt.Sprintf("(%d lines before)", len(lines)-40)}, lines[len(lines)-40:]...)
	}
	return "\t" + strings.Join(lines, "\n\t")
}
