// Package valuesdoc writes the values table of the chart's README from values.yaml: one row per
// value, with its type, its default and the comment above it. cmd/chart-readme writes it into
// the README; a test of e2e/manifests checks that the README's table is current.
package valuesdoc

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
)

// The markers between which the README holds the generated table.
const (
	Begin = "<!-- values-table: begin (generated from values.yaml by `make chart-readme`; do not edit) -->"
	End   = "<!-- values-table: end -->"
)

// row is one value of the table.
type row struct {
	key, typ, def, desc string
}

// Table returns the Markdown table of the values file b. A mapping is documented value by value
// when a key in it has a comment of its own, and as one value otherwise (a pod security
// context, resources: passed to Kubernetes as they are).
func Table(b []byte) (string, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return "", err
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return "", errors.New("values: not a mapping")
	}
	var rows []row
	if err := walk(doc.Content[0], "", &rows); err != nil {
		return "", err
	}
	var out strings.Builder
	out.WriteString("| Key | Type | Default | Description |\n|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&out, "| `%s` | %s | %s | %s |\n", r.key, r.typ, cell(r.def, true), cell(r.desc, false))
	}
	return out.String(), nil
}

func walk(m *yaml.Node, prefix string, rows *[]row) error {
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		key := prefix + k.Value
		if v.Kind == yaml.MappingNode && documentedInside(v) {
			if err := walk(v, key+".", rows); err != nil {
				return err
			}
			continue
		}
		var val any
		if err := v.Decode(&val); err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		def, err := compact(val)
		if err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		*rows = append(*rows, row{key: key, typ: typeOf(v), def: def, desc: description(k.HeadComment)})
	}
	return nil
}

// documentedInside reports whether a key of the mapping has a comment.
func documentedInside(m *yaml.Node) bool {
	for i := 0; i < len(m.Content); i += 2 {
		if m.Content[i].HeadComment != "" {
			return true
		}
	}
	return false
}

func typeOf(v *yaml.Node) string {
	switch v.Kind {
	case yaml.SequenceNode:
		return "list"
	case yaml.MappingNode:
		return "object"
	}
	switch v.Tag {
	case "!!int":
		return "int"
	case "!!float":
		return "number"
	case "!!bool":
		return "bool"
	case "!!null":
		return "null"
	}
	return "string"
}

// compact is a default as one line of JSON (a string quoted, so that "" shows).
func compact(v any) (string, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return "", err
	}
	return strings.TrimSpace(b.String()), nil
}

// description is the last paragraph of a key's comment (the paragraphs before it, separated by
// a blank line, belong to the section above), as one line.
func description(c string) string {
	paras := strings.Split(strings.TrimSpace(c), "\n\n")
	var words []string
	for _, l := range strings.Split(paras[len(paras)-1], "\n") {
		l = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), "#"))
		if l != "" {
			words = append(words, l)
		}
	}
	return strings.Join(words, " ")
}

// cell makes s safe in a table cell, as code or as text.
func cell(s string, code bool) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	if code {
		return "`" + s + "`"
	}
	// <kubeletDir> and the like are text, not HTML.
	return strings.NewReplacer("<", "&lt;", ">", "&gt;").Replace(s)
}

// Update returns readme with the table between Begin and End replaced by table.
func Update(readme []byte, table string) ([]byte, error) {
	b, e := bytes.Index(readme, []byte(Begin)), bytes.Index(readme, []byte(End))
	if b < 0 || e < b {
		return nil, fmt.Errorf("the README has no %q … %q", Begin, End)
	}
	var out bytes.Buffer
	out.Write(readme[:b+len(Begin)])
	out.WriteString("\n" + table)
	out.Write(readme[e:])
	return out.Bytes(), nil
}
