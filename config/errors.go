package config

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Every problem is a field.Error, kubelet's vocabulary: the field path, the kind of problem,
// the offending value and a detail. A problem of the YAML itself (syntax, a second document)
// has no path: its detail carries the line.

// omit stands for "no value to show" in a field.Error.
var omit = field.OmitValueType{}

func yamlError(msg string) *field.Error {
	return &field.Error{Type: field.ErrorTypeInvalid, BadValue: omit, Detail: strings.ReplaceAll(msg, "\n", " ")}
}

// child is the path of a field of the mapping at p; nil is the top level. A key that would
// not print on one line (a line break, a control character) is quoted, so that each problem
// stays one line.
func child(p *field.Path, name string) *field.Path {
	if strings.ContainsFunc(name, func(r rune) bool { return !unicode.IsPrint(r) }) {
		name = strconv.Quote(name)
	}
	if p == nil {
		return field.NewPath(name)
	}
	return p.Child(name)
}

// joined returns the problems as one error of one line each, "path: value: detail", in file
// order: the top-level fields as the file format lists them, then each driver by index.
func joined(errs field.ErrorList) error {
	slices.SortStableFunc(errs, func(a, b *field.Error) int {
		ra, ia := position(a.Field)
		rb, ib := position(b.Field)
		return cmp.Or(cmp.Compare(ra, rb), cmp.Compare(ia, ib))
	})
	lines := make([]error, len(errs))
	for i, e := range errs {
		lines[i] = errors.New(render(e))
	}
	return errors.Join(lines...)
}

// render writes a problem the way multireg always has. field.Error's own Error() would say
// "Invalid value:" and "Required value" on every line, and change what users and scripts read.
func render(e *field.Error) string {
	parts := []string{e.Field}
	switch {
	case e.Type == field.ErrorTypeRequired:
		parts = append(parts, "required")
	case e.Type != field.ErrorTypeForbidden && e.BadValue != omit:
		parts = append(parts, formatValue(e.BadValue))
	}
	parts = append(parts, e.Detail)
	return strings.Join(slices.DeleteFunc(parts, func(s string) bool { return s == "" }), ": ")
}

// position is where a field path stands in the file: its top-level field's rank (no path
// first, unknown fields last) and, for drivers, the index.
func position(path string) (rank, index int) {
	if path == "" {
		return 0, 0
	}
	if rank = slices.Index(topFields, path[:strings.IndexAny(path+".", ".[")]) + 1; rank == 0 {
		rank = len(topFields) + 1
	}
	_, _ = fmt.Sscanf(path, "drivers[%d]", &index)
	return rank, index
}

// unknownField is the detail for a field that is not one of known, with the known field
// closest to it if it is a likely typo.
func unknownField(name string, known []string) string {
	best, bestDist := "", 3
	for _, k := range known {
		if strings.EqualFold(k, name) {
			best = k
			break
		}
		if d := editDistance(strings.ToLower(name), strings.ToLower(k)); d < bestDist {
			best, bestDist = k, d
		}
	}
	if best == "" {
		return "unknown field"
	}
	return fmt.Sprintf("unknown field (did you mean %q?)", best)
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// nodeValue is what a node holds, for a message: a string's text, or the value YAML reads.
func nodeValue(n *yaml.Node) any {
	if s, ok := stringValue(n); ok {
		return s
	}
	if b, ok := yaml11Bool(n); ok {
		return b
	}
	var v any
	if n.Decode(&v) != nil {
		return n.Value
	}
	return v
}

// formatValue renders a value for a message: a string quoted, a list or mapping as JSON.
func formatValue(v any) string {
	switch x := v.(type) {
	case string:
		return strconv.Quote(x)
	case float64: // as YAML writes it: .inf, -.inf, .nan
		b, _ := yaml.Marshal(x)
		return strings.TrimSpace(string(b))
	case time.Duration:
		return x.String()
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	if len(b) > 60 {
		return string(b[:57]) + "..."
	}
	return string(b)
}
