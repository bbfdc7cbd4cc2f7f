package manifests

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

var (
	// inlineLink is a Markdown link or image, [text](target "title"), its target in group 1.
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	// refLink is a link reference definition, [label]: target.
	refLink = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s+<?([^\s>]+)>?`)
	// codeSpan is inline code, whose brackets are no links.
	codeSpan = regexp.MustCompile("`+[^`]*`+")
	// htmlAnchor is an anchor written in HTML.
	htmlAnchor = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	// scheme starts a link that leaves the repository.
	scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// mdLine is one line of a Markdown file outside its fenced code blocks.
type mdLine struct {
	n    int
	text string
}

func markdownLines(b []byte) []mdLine {
	var lines []mdLine
	fence := ""
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		l := sc.Text()
		t := strings.TrimLeft(l, " ")
		switch {
		case fence != "":
			if strings.HasPrefix(t, fence) {
				fence = ""
			}
			continue
		case strings.HasPrefix(t, "```"), strings.HasPrefix(t, "~~~"):
			fence = t[:3]
			continue
		}
		lines = append(lines, mdLine{n, l})
	}
	return lines
}

// headingAnchor is the anchor GitHub gives a heading: lower case, the text of its links and
// code, letters, digits, - and _ kept, each space a -.
func headingAnchor(h string) string {
	h = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(h, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(h)) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

// anchors returns the anchors of a Markdown file: its headings' (a repeated heading's with -1,
// -2, … as GitHub numbers them) and its HTML anchors.
func anchors(b []byte) map[string]bool {
	as := map[string]bool{}
	seen := map[string]int{}
	for _, l := range markdownLines(b) {
		for _, m := range htmlAnchor.FindAllStringSubmatch(l.text, -1) {
			as[m[1]] = true
		}
		t := strings.TrimLeft(l.text, " ")
		level := len(t) - len(strings.TrimLeft(t, "#"))
		if level == 0 || level > 6 || len(t) == level || t[level] != ' ' {
			continue
		}
		a := headingAnchor(strings.TrimRight(strings.TrimSpace(t[level:]), "#"))
		if n := seen[a]; n > 0 {
			as[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			as[a] = true
		}
		seen[a]++
	}
	return as
}

// brokenLinks checks every Markdown file under root that the docs are made of: each relative
// link must name a file or directory that exists, and a #anchor into a Markdown file one of
// its headings. It returns one line per broken link, file:line: target: why.
func brokenLinks(root string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "bin" || d.Name() == "testdata" || d.Name() == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.Sort(files)
	anchorsOf := map[string]map[string]bool{}
	anchorsIn := func(p string) (map[string]bool, error) {
		if as, ok := anchorsOf[p]; ok {
			return as, nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		anchorsOf[p] = anchors(b)
		return anchorsOf[p], nil
	}
	var broken []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		rel, _ := filepath.Rel(root, f)
		for _, l := range markdownLines(b) {
			text := codeSpan.ReplaceAllString(l.text, "")
			var targets []string
			for _, m := range inlineLink.FindAllStringSubmatch(text, -1) {
				targets = append(targets, m[1])
			}
			if m := refLink.FindStringSubmatch(text); m != nil {
				targets = append(targets, m[1])
			}
			for _, target := range targets {
				if scheme.MatchString(target) || strings.HasPrefix(target, "//") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				dest := f
				if path != "" {
					if strings.HasPrefix(path, "/") {
						dest = filepath.Join(root, filepath.FromSlash(path))
					} else {
						dest = filepath.Join(filepath.Dir(f), filepath.FromSlash(path))
					}
					if _, err := os.Stat(dest); err != nil {
						broken = append(broken, fmt.Sprintf("%s:%d: %s: no such file or directory", rel, l.n, target))
						continue
					}
				}
				if anchor == "" || !strings.HasSuffix(dest, ".md") {
					continue
				}
				as, err := anchorsIn(dest)
				if err != nil {
					return nil, err
				}
				if !as[anchor] {
					broken = append(broken, fmt.Sprintf("%s:%d: %s: no heading with the anchor #%s", rel, l.n, target, anchor))
				}
			}
		}
	}
	return broken, nil
}

// TestDocLinks: every relative link of the repository's Markdown (README, CONTRIBUTING,
// SECURITY, CHANGELOG, docs/, the chart's README, e2e's READMEs, examples/) names a file or
// directory that exists, and every #anchor a heading of its file.
func TestDocLinks(t *testing.T) {
	broken, err := brokenLinks(repoRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range broken {
		t.Error(b)
	}
}

// TestDocLinksFindsBrokenLinks: the check finds a link to a missing file, to a missing heading
// of another file or of its own, and nothing in a code block, in inline code or outside the
// repository.
func TestDocLinksFindsBrokenLinks(t *testing.T) {
	root := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		p := filepath.Join(root, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("README.md", "# Top\n\n"+
		"See [the guide](docs/guide.md), [its install](docs/guide.md#install-with-helm), [the code](cmd/),\n"+
		"[gone](docs/gone.md), [no such part](docs/guide.md#uninstall), [here](#top), [nowhere](#bottom),\n"+
		"[the web](https://example.com/x.md), `[code](missing.md)` and ![a picture](docs/pic.png).\n\n"+
		"```sh\n[in a block](also-missing.md)\n```\n\n"+
		"[ref]: docs/missing-ref.md\n")
	write("docs/guide.md", "# Guide\n\n## Install with Helm\n\n## Upgrade\n\n## Upgrade\n\nBack to [the top](../README.md#top), [the second upgrade](#upgrade-1).\n")
	write("docs/pic.png", "")
	write("cmd/main.go", "package main\n")
	got, err := brokenLinks(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"README.md:4: docs/gone.md: no such file or directory",
		"README.md:4: docs/guide.md#uninstall: no heading with the anchor #uninstall",
		"README.md:4: #bottom: no heading with the anchor #bottom",
		"README.md:11: docs/missing-ref.md: no such file or directory",
	}
	if !slices.Equal(got, want) {
		t.Errorf("broken links:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
