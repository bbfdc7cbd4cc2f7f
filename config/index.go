package config

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strconv"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// index holds the document's nodes by line, each with its field path and the Go type the
// decoder reads it into, in the order the decoder visits them. It goes where the decoder
// goes, aliases included, and no further: not into an unknown field, nor into a value of the
// wrong kind. On the way it reports what the decoder would take silently: a merge key ("<<"),
// which it would apply, and a null key, which it would drop.
type index struct {
	lines map[int][]site
	next  map[int]int // per line, the first site not yet matched to a message
	errs  field.ErrorList
	merge bool
}

// site is a node with its field path and type; a key has its value's path and the type of
// the struct it is in.
type site struct {
	n    *yaml.Node
	key  bool
	path *field.Path
	t    reflect.Type
}

func newIndex(root *yaml.Node) *index {
	ix := &index{lines: map[int][]site{}, next: map[int]int{}}
	ix.walk(root, nil, reflect.TypeFor[file]())
	return ix
}

func (ix *index) add(s site) {
	ix.lines[s.n.Line] = append(ix.lines[s.n.Line], s)
}

func (ix *index) walk(n *yaml.Node, p *field.Path, t reflect.Type) {
	n = resolved(n)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	ix.add(site{n, false, p, t})
	switch {
	case n.Kind == yaml.MappingNode && t.Kind() == reflect.Struct:
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			switch k.ShortTag() {
			case "!!merge":
				where := p
				if where == nil {
					where = field.NewPath("top level")
				}
				ix.errs = append(ix.errs, field.Forbidden(where, fmt.Sprintf(`line %d: YAML merge keys ("<<") are not supported: write the fields out`, k.Line)))
				ix.merge = true
				continue
			case "!!null":
				ix.errs = append(ix.errs, field.Forbidden(child(p, "null"), "unknown field"))
			}
			kp := child(p, k.Value)
			ix.add(site{k, true, kp, t})
			if j := slices.IndexFunc(fields, func(f reflect.StructField) bool { return f.Name == k.Value }); j >= 0 {
				ix.walk(n.Content[i+1], kp, fields[j].Type)
			}
		}
	case n.Kind == yaml.SequenceNode && t.Kind() == reflect.Slice:
		for i, c := range n.Content {
			ix.walk(c, p.Index(i), t.Elem())
		}
	}
}

// The decoder reports each problem as text, "line N: ...". These patterns read what follows
// the line in the messages it writes, and in wrongType's.
var (
	lineRE      = regexp.MustCompile(`(?s)^line (\d+): (.*)$`)
	wrongTypeRE = regexp.MustCompile(`(?s)^column (\d+): (must be .*)$`)
	unknownRE   = regexp.MustCompile(`(?s)^field (.*) not found in type (\S+)$`)
	kindRE      = regexp.MustCompile("(?s)^cannot unmarshal (!!\\w+)(?: `.*`)? into (\\S+)$")
	duplicateRE = regexp.MustCompile(`(?s)^mapping key (".*") already defined at line \d+$`)
)

// locate turns the decoder's messages into field errors, each at the path of the node it is
// about, and records those paths in failed. A key given twice is reported alone, as YAML,
// and stops the checks: the file's structure is in doubt. A message it cannot place is kept
// as it is, with its line.
func (ix *index) locate(msgs []string, failed map[string]bool) (errs field.ErrorList, duplicate bool) {
	for _, m := range msgs {
		if line, msg := splitLine(m); duplicateRE.MatchString(msg) {
			errs = append(errs, yamlError(fmt.Sprintf("yaml: line %d: key %s already set in map", line, duplicateRE.FindStringSubmatch(msg)[1])))
		}
	}
	if len(errs) > 0 {
		return errs, true
	}
	for _, m := range msgs {
		e := ix.fieldError(splitLine(m))
		if e == nil {
			e = yamlError("yaml: " + m)
		} else {
			failed[e.Field] = true
		}
		errs = append(errs, e)
	}
	return errs, false
}

// splitLine splits a decoder message into its line and the rest; 0 if it has no line.
func splitLine(m string) (int, string) {
	sm := lineRE.FindStringSubmatch(m)
	if sm == nil {
		return 0, m
	}
	line, _ := strconv.Atoi(sm[1])
	return line, sm[2]
}

func (ix *index) fieldError(line int, msg string) *field.Error {
	if sm := wrongTypeRE.FindStringSubmatch(msg); sm != nil {
		col, _ := strconv.Atoi(sm[1])
		if s := ix.take(line, func(s site) bool { return !s.key && s.n.Column == col }); s != nil {
			return field.TypeInvalid(s.path, nodeValue(s.n), sm[2])
		}
	}
	if sm := unknownRE.FindStringSubmatch(msg); sm != nil {
		if s := ix.take(line, func(s site) bool { return s.key && s.n.Value == sm[1] && s.t.String() == sm[2] }); s != nil {
			return field.Forbidden(s.path, unknownField(sm[1], s.t))
		}
	}
	if sm := kindRE.FindStringSubmatch(msg); sm != nil {
		if s := ix.take(line, func(s site) bool { return !s.key && s.n.ShortTag() == sm[1] && s.t.String() == sm[2] }); s != nil {
			want := "a mapping"
			if s.t.Kind() == reflect.Slice {
				want = "a list"
			}
			return field.TypeInvalid(s.path, nodeValue(s.n), "must be "+want)
		}
	}
	return nil
}

// take returns the first site on line, after the last one taken there, that match accepts:
// the decoder reports in the order it visits.
func (ix *index) take(line int, match func(site) bool) *site {
	sites := ix.lines[line]
	for i := ix.next[line]; i < len(sites); i++ {
		if match(sites[i]) {
			ix.next[line] = i + 1
			return &sites[i]
		}
	}
	return nil
}
