package config

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// decode reads the file's one YAML document into the file format. It returns the file (nil
// when nothing more can be checked), every problem found, each with its field path or its
// line, and the paths that failed to decode: validating their zero value would only add a
// second, misleading error.
func decode(b []byte) (*file, map[string]bool, field.ErrorList) {
	root, errs := document(b)
	if root == nil {
		return nil, nil, errs
	}
	d := &decoder{failed: map[string]bool{}}
	f := d.file(root)
	if errs = append(errs, d.keys...); d.fatal {
		return nil, nil, errs
	}
	return f, d.failed, append(errs, d.errs...)
}

// document parses b into nodes and returns its document's top mapping, or nil. It reports
// a second document, which it ignores, and an alias bomb ("billion laughs") anywhere in the
// file. A leading "---" is one document, and so is a file that ends in a "---" with nothing
// after it.
func document(b []byte) (*yaml.Node, field.ErrorList) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	var doc yaml.Node
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
		return nil, field.ErrorList{yamlError("the file is empty")}
	} else if err != nil {
		return nil, field.ErrorList{yamlError(err.Error())}
	}
	errs := secondDocument(dec)
	root := doc.Content[0]
	switch {
	case isNull(root):
		return nil, append(errs, yamlError("the file is empty"))
	case root.Kind != yaml.MappingNode:
		return nil, append(errs, field.TypeInvalid(field.NewPath("top level"), nodeValue(root), "must be a mapping with apiVersion, kind and drivers"))
	}
	// Decoding the whole document, whatever its fields, refuses an alias bomb anywhere in it
	// (the library bounds what aliases may expand to), an anchor that contains itself and a
	// key YAML cannot use. The decoder's walk visits no more nodes than this decoding did.
	var all any
	if err := root.Decode(&all); err != nil && !errors.As(err, new(*yaml.TypeError)) {
		return nil, append(errs, yamlError(err.Error()))
	}
	return root, errs
}

// secondDocument reports a document after the first that is not empty, or that does not parse.
func secondDocument(dec *yaml.Decoder) field.ErrorList {
	for {
		var next yaml.Node
		err := dec.Decode(&next)
		switch {
		case errors.Is(err, io.EOF):
			return nil
		case err != nil:
			return field.ErrorList{yamlError(err.Error() + " (in a second YAML document: a drivers file holds exactly one)")}
		case len(next.Content) > 0 && !isEmptyDocument(next.Content[0]):
			return field.ErrorList{yamlError(fmt.Sprintf("yaml: line %d: a second YAML document: a drivers file holds exactly one", next.Line))}
		}
	}
}

// isEmptyDocument reports whether a document holds nothing at all: "---" followed by nothing
// but comments, as opposed to an explicit "~" or "null".
func isEmptyDocument(n *yaml.Node) bool {
	return isNull(n) && n.Value == "" && n.Style == 0 && n.Anchor == ""
}

func isNull(n *yaml.Node) bool {
	return resolved(n).ShortTag() == "!!null"
}

// resolved follows an alias to the node it names.
func resolved(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

// decoder reads the document's nodes into the file format. Each value is read by the
// function for its type, which is handed the value's field path: a problem is reported where
// it is found, and reading goes on past it, so that one pass reports every problem.
type decoder struct {
	errs   field.ErrorList
	failed map[string]bool // the paths of the values that failed to decode
	keys   field.ErrorList // null keys, merge keys and keys given twice
	fatal  bool            // a merge key or a key given twice: the structure is in doubt
}

// fail reports the value n at p, which is not what its field takes.
func (d *decoder) fail(p *field.Path, n *yaml.Node, want string) {
	d.errs = append(d.errs, field.TypeInvalid(p, nodeValue(n), "must be "+want))
	d.failed[p.String()] = true
}

// invalid reports a value of the right type that its field does not accept, unless the
// field's own value failed to decode.
func (d *decoder) invalid(p *field.Path, v any, detail string) {
	if !d.failed[p.String()] {
		d.errs = append(d.errs, field.Invalid(p, v, detail))
	}
}

// mapping calls set with each key of the mapping n, its value and the value's path. It
// refuses a key not in known (naming the closest known one), a null key, a key given twice,
// and a merge key ("<<"), which the library's decoder would apply. A null value is a field
// left out.
func (d *decoder) mapping(n *yaml.Node, p *field.Path, known []string, set func(k string, v *yaml.Node, p *field.Path)) {
	if n.Kind != yaml.MappingNode {
		d.fail(p, n, "a mapping")
		return
	}
	d.repeated(n)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := resolved(n.Content[i]), resolved(n.Content[i+1])
		switch {
		case k.ShortTag() == "!!merge":
			where := p
			if where == nil {
				where = field.NewPath("top level")
			}
			d.keys = append(d.keys, field.Forbidden(where, fmt.Sprintf(`line %d: YAML merge keys ("<<") are not supported: write the fields out`, k.Line)))
			d.fatal = true
		case k.ShortTag() == "!!null":
			d.keys = append(d.keys, field.Forbidden(child(p, "null"), "unknown field"))
		case !slices.Contains(known, k.Value):
			d.errs = append(d.errs, field.Forbidden(child(p, k.Value), unknownField(k.Value, known)))
		case !isNull(v):
			set(k.Value, v, child(p, k.Value))
		}
	}
}

// repeated reports each key of the mapping n that is given twice.
func (d *decoder) repeated(n *yaml.Node) {
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := resolved(n.Content[i])
		if seen[k.Value] {
			d.keys = append(d.keys, yamlError(fmt.Sprintf("yaml: line %d: key %q already set in map", k.Line, k.Value)))
			d.fatal = true
		}
		seen[k.Value] = true
	}
}

// list reads each element of the list n with elem; a null element is null.
func list[T any](d *decoder, n *yaml.Node, p *field.Path, null T, elem func(*yaml.Node, *field.Path) T) []T {
	if n.Kind != yaml.SequenceNode {
		if n.Kind == yaml.MappingNode {
			d.repeated(n) // which is all that is reported, as for any mapping
		}
		d.fail(p, n, "a list")
		return nil
	}
	s := make([]T, len(n.Content))
	for i, v := range n.Content {
		if s[i] = null; !isNull(v) {
			s[i] = elem(resolved(v), p.Index(i))
		}
	}
	return s
}

// str reads a YAML string. It refuses a number or a boolean (name: 123), which the library
// would take as its text, and a string that is not UTF-8 (from !!binary).
func (d *decoder) str(n *yaml.Node, p *field.Path) string {
	v, ok := stringValue(n)
	switch {
	case !ok:
		d.fail(p, n, "a string")
	case !utf8.ValidString(v):
		d.fail(p, n, "valid UTF-8")
	default:
		return v
	}
	return ""
}

// boolean reads true or false, or one of the YAML 1.1 words for them (yes, no, on, off, y,
// n), which drivers files have always accepted. A quoted "false" is a string.
func (d *decoder) boolean(n *yaml.Node, p *field.Path) (bool, bool) {
	v, ok := yaml11Bool(n)
	if !ok && n.ShortTag() == "!!bool" {
		ok = n.Decode(&v) == nil
	}
	if !ok {
		d.fail(p, n, "true or false")
	}
	return v, ok
}

// number reads a finite number; a quoted "2" is a string.
func (d *decoder) number(n *yaml.Node, p *field.Path) (float64, bool) {
	v, ok := numberValue(n)
	switch {
	case !ok:
		d.fail(p, n, "a number")
	case math.IsInf(v, 0) || math.IsNaN(v):
		d.fail(p, n, "a finite number")
	default:
		return v, true
	}
	return 0, false
}

// duration reads a Go duration string ("500ms", "2m"). A bare 0 is zero in any unit; any
// other bare number lacks one (5 is not 5 seconds).
func (d *decoder) duration(n *yaml.Node, p *field.Path) (time.Duration, bool) {
	if f, ok := numberValue(n); ok && f == 0 {
		return 0, true
	}
	s, ok := stringValue(n)
	v, err := time.ParseDuration(s)
	if !ok || err != nil {
		d.fail(p, n, `a duration such as "500ms" or "2m"`)
		return 0, false
	}
	return v, true
}

// stringValue returns the text of a scalar that YAML reads as a string: plain or quoted, the
// bytes of !!binary, or, as written, a timestamp or a value with a tag YAML does not resolve
// ("!x").
func stringValue(n *yaml.Node) (string, bool) {
	if n.Kind != yaml.ScalarNode {
		return "", false
	}
	switch n.ShortTag() {
	case "!!str":
		_, isBool := yaml11Bool(n)
		return n.Value, !isBool
	case "!!binary":
		b, err := base64.StdEncoding.DecodeString(n.Value)
		return string(b), err == nil
	case "!!bool", "!!int", "!!float", "!!null":
		return "", false
	}
	return n.Value, true
}

func numberValue(n *yaml.Node) (v float64, ok bool) {
	t := n.ShortTag()
	ok = n.Kind == yaml.ScalarNode && (t == "!!int" || t == "!!float") && n.Decode(&v) == nil
	return v, ok
}

// yaml11Bool reads a plain y, yes, on, n, no or off, in any of its YAML 1.1 spellings.
func yaml11Bool(n *yaml.Node) (value, ok bool) {
	if n.Kind != yaml.ScalarNode || n.Style != 0 || n.ShortTag() != "!!str" {
		return false, false
	}
	switch n.Value {
	case "y", "Y", "yes", "Yes", "YES", "on", "On", "ON":
		return true, true
	case "n", "N", "no", "No", "NO", "off", "Off", "OFF":
		return false, true
	}
	return false, false
}
