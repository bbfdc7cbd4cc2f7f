package manifests

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// deployDoc returns docs/deploy.md and its fenced blocks in the given language, each with its
// continuation lines ("\" at the end) joined into one.
func deployDoc(t *testing.T, lang string) (doc string, blocks []string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "deploy.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc = string(b)
	for _, m := range regexp.MustCompile("(?ms)^```"+lang+"\n(.*?)^```").FindAllStringSubmatch(doc, -1) {
		blocks = append(blocks, regexp.MustCompile(`\\\n\s*`).ReplaceAllString(m[1], ""))
	}
	if len(blocks) == 0 {
		t.Fatalf("docs/deploy.md has no %s block", lang)
	}
	return doc, blocks
}

// TestDeployDocValues renders the chart with the values file docs/deploy.md shows: it must
// render, and multireg must accept the drivers file.
func TestDeployDocValues(t *testing.T) {
	_, blocks := deployDoc(t, "yaml")
	var values map[string]any
	for _, b := range blocks {
		if strings.HasPrefix(b, "# my-values.yaml\n") {
			values = mustValues(t, b)
		}
	}
	if values == nil {
		t.Fatal("docs/deploy.md shows no my-values.yaml")
	}
	out, err := renderChart(loadChart(t), values)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeManifests([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	checkDeployment(t, "docs/deploy.md's my-values.yaml", m, expectations{root: kubeletRoot})
}

// TestDeployDocCommands checks the shell commands of docs/deploy.md against what following them
// literally on a node showed: the render check must not hide a failing `helm template` behind
// a pipe and must work with Debian's yq (which needs -r); an uninstall must wait for the pods
// to be gone; `helm upgrade` must be given every value; the cleanup by hand must remove
// multireg's sockets only, under any kubeletDir; and multireg must accept every command line
// of its own.
func TestDeployDocCommands(t *testing.T) {
	doc, blocks := deployDoc(t, "sh")
	var lines []string
	for _, b := range blocks {
		for _, l := range strings.Split(b, "\n") {
			l = regexp.MustCompile(`\s+#.*$`).ReplaceAllString(l, "") // a comment
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				lines = append(lines, l)
			}
		}
	}
	var checked, renderChecks int
	for _, l := range lines {
		if strings.Contains(l, "helm template") {
			renderChecks++
			if strings.Contains(l, "|") && !strings.Contains(doc, "set -o pipefail") {
				t.Errorf("%q: a pipe after helm template hides its failure", l)
			}
		}
		for _, m := range regexp.MustCompile(`\byq\b([^|&;]*)`).FindAllStringSubmatch(l, -1) {
			if !slicesContainsField(m[1], "-r") {
				t.Errorf("%q: yq without -r (Debian's yq prints a JSON string)", l)
			}
		}
		if strings.Contains(l, " uninstall ") || strings.HasPrefix(l, "kubectl delete -k") {
			if !strings.Contains(l, "--cascade=foreground") || !strings.Contains(l, "--wait") {
				t.Errorf("%q: returns while the pods still run; want --cascade=foreground --wait", l)
			}
		}
		if strings.Contains(l, "helm ") && strings.Contains(l, " upgrade ") &&
			!strings.Contains(l, " -f ") && !strings.Contains(l, "reuse-values") {
			t.Errorf("%q: values left out go back to the chart's defaults; want -f with every value, or --reuse-values", l)
		}
		if strings.HasPrefix(l, "rm ") && strings.Contains(l, "-reg.sock") {
			t.Errorf("%q: removes other registrars' sockets too; remove those .multireg.sockets lists", l)
		}
		// multireg's own command lines, in a pod or not: multireg must accept their flags.
		if m := regexp.MustCompile(`(?:^|[\s/])multireg ((?:status|validate)[^|&;]*)`).FindStringSubmatch(l); m != nil {
			checked++
			if err := checkArgs(t, strings.Fields(m[1])); err != nil {
				t.Error(err)
			}
		}
	}
	if renderChecks == 0 || checked == 0 {
		t.Errorf("docs/deploy.md: %d helm template lines, %d multireg command lines; want some of each", renderChecks, checked)
	}
	for _, want := range []string{".multireg.sockets", ".multireg.lock", ".multireg.handover", "kubeletDir", "rollout status", "--reuse-values"} {
		if !strings.Contains(doc, want) {
			t.Errorf("docs/deploy.md does not name %s", want)
		}
	}
}

// slicesContainsField reports whether the command line s has the field f.
func slicesContainsField(s, f string) bool {
	for _, x := range strings.Fields(s) {
		if x == f {
			return true
		}
	}
	return false
}
