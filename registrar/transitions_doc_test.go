package registrar

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// update rewrites the docs written from the table (go generate ./registrar).
var update = flag.Bool("update", false, "rewrite the package comment's table of transitions and docs/architecture.md's diagram from the table")

// The docs written from the table: the package comment's table, between its heading line and
// the next heading, and docs/architecture.md's diagram, the Mermaid block after its marker.
const (
	docFile     = "doc.go"
	docHeading  = "// Transitions, as the table in machine.go has them (go generate writes them here):\n"
	diagramFile = "../docs/architecture.md"
	diagramMark = "<!-- The diagram below is written from registrar/machine.go's table by go generate ./registrar: do not edit it. -->\n"
)

// starts are the states a loop starts in (newLoop), for the diagram.
var starts = []dest{
	{stWaitingForEndpoint, "a new driver"},
	{stTakingOver, "a hand-over, with sockets"},
	{stBackingOff, "a hand-over, backing off"},
}

// docTable is the package comment's table of transitions: a line per row and destination.
func docTable() string {
	name := func(s state) string {
		if s == anyState {
			return "(any)"
		}
		return s.String()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "//\t%-19s %-18s %-19s %s\n", "from", "event", "to", "what the loop does")
	for _, r := range rows {
		for _, d := range r.to {
			to := name(d.to)
			if d.to == anyState {
				to = "(the same)"
			}
			fmt.Fprintf(&b, "//\t%-19s %-18s %-19s %s\n", name(r.from), r.on, to, d.what)
		}
	}
	return b.String()
}

// diagram is docs/architecture.md's Mermaid state diagram: an edge per pair of states, with
// the events that lead from one to the other; the rows of any state from one node that
// stands for them all. Reload, which leaves every state as it is, is said under the diagram.
func diagram() string {
	var b strings.Builder
	b.WriteString("```mermaid\nstateDiagram-v2\n  direction LR\n")
	for _, s := range starts {
		fmt.Fprintf(&b, "  [*] --> %s: %s\n", s.to, s.what)
	}
	type edge struct{ from, to state }
	var order []edge
	events := map[edge][]string{}
	for _, r := range rows {
		if r.from == anyState {
			continue
		}
		for _, d := range r.to {
			e := edge{r.from, d.to}
			if !slices.Contains(order, e) {
				order = append(order, e)
			}
			if !slices.Contains(events[e], r.on.String()) {
				events[e] = append(events[e], r.on.String())
			}
		}
	}
	for _, e := range order {
		fmt.Fprintf(&b, "  %s --> %s: %s\n", e.from, e.to, strings.Join(events[e], ", "))
	}
	b.WriteString("  state \"any state\" as Any\n")
	var ends []string
	for _, r := range rows {
		if r.from == anyState && r.on != evReload {
			ends = append(ends, r.on.String())
		}
	}
	fmt.Fprintf(&b, "  Any --> Stopped: %s\n", strings.Join(ends, ", "))
	b.WriteString("  Stopped --> [*]\n```\n")
	return b.String()
}

// TestTransitionDocs: the package comment's table of transitions and docs/architecture.md's
// diagram are the ones the table writes; -update (go generate) writes them.
func TestTransitionDocs(t *testing.T) {
	for _, f := range []struct {
		path, mark string
		body       string
		end        func(rest string) int // where the written part ends in what follows the mark
	}{
		{docFile, docHeading + "//\n", docTable(), func(rest string) int {
			if i := strings.Index(rest, "//\n// #"); i >= 0 {
				return i
			}
			return -1
		}},
		{diagramFile, diagramMark, diagram(), func(rest string) int {
			if i := strings.Index(rest, "\n```\n"); strings.HasPrefix(rest, "```mermaid\n") && i >= 0 {
				return i + len("\n```\n")
			}
			return -1
		}},
	} {
		b, err := os.ReadFile(f.path)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		i := strings.Index(text, f.mark)
		if i < 0 {
			t.Errorf("%s has no %q", f.path, strings.TrimSpace(f.mark))
			continue
		}
		start := i + len(f.mark)
		n := f.end(text[start:])
		if n < 0 {
			t.Errorf("%s: the written part after %q has no end", f.path, strings.TrimSpace(f.mark))
			continue
		}
		if got := text[start : start+n]; got != f.body {
			if *update {
				if err := os.WriteFile(f.path, []byte(text[:start]+f.body+text[start+n:]), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			t.Errorf("%s is not what the table writes (go generate ./registrar writes it):\n%s\nwant:\n%s", filepath.Clean(f.path), got, f.body)
		}
	}
}
