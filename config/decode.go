package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// decode reads the file's one YAML document into the file format with the library's strict
// decoder. It returns the file (nil when nothing more can be checked), every problem found,
// each with its field path or its line, and the paths that failed to decode: validating their
// zero value would only add a second, misleading error. Decoding goes on past a bad field,
// so that one pass reports every problem.
func decode(b []byte) (*file, map[string]bool, field.ErrorList) {
	root, errs := document(b)
	if root == nil {
		return nil, nil, errs
	}
	ix := newIndex(root)
	if errs = append(errs, ix.errs...); ix.merge {
		return nil, nil, errs
	}
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	err := dec.Decode(&f)
	var te *yaml.TypeError
	if err != nil && !errors.As(err, &te) {
		return nil, nil, append(errs, yamlError(err.Error()))
	}
	failed := map[string]bool{}
	if te != nil {
		located, duplicate := ix.locate(te.Errors, failed)
		if errs = append(errs, located...); duplicate {
			return nil, nil, errs
		}
	}
	drivers := field.NewPath("drivers")
	f.Drivers = keepIndexes(f.Drivers, drivers, failed)
	for i, d := range f.Drivers {
		if d != nil {
			d.SupportedVersions = keepIndexes(d.SupportedVersions, drivers.Index(i).Child("supportedVersions"), failed)
		}
	}
	return &f, failed, errs
}

// document parses b into nodes and returns its document's top mapping, or nil. It reports
// what the strict decoder would not: a second document, which it ignores, and an alias bomb
// ("billion laughs") in a field it skips. A leading "---" is one document, and so is a file
// that ends in a "---" with nothing after it.
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
	// (the library bounds what aliases may expand to) and a key YAML cannot use.
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

// keepIndexes puts a nil back where the decoder left out a list element that failed to
// decode, so that the elements after it keep the index the file gives them. (A null element
// is kept: the lists hold pointers.)
func keepIndexes[T any](s []*T, p *field.Path, failed map[string]bool) []*T {
	for i := 0; i <= len(s); i++ {
		if failed[p.Index(i).String()] {
			s = slices.Insert(s, i, nil)
		}
	}
	return s
}
