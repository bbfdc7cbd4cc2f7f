package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"

	yamlnode "go.yaml.in/yaml/v3"
)

// checkDocuments reports, with their lines, what the strict decoder does not see or would
// misreport: a second YAML document, which it ignores, and merge keys ("<<"), which it reports
// as duplicate keys. It returns false when decoding must not go on.
//
// A leading "---" is one document. So is a file that ends in a "---" with nothing after it:
// an empty document holds no setting that could be lost. A file that the YAML parser cannot
// read here is left to the decoder, which reports the syntax error.
//
// The walk keeps aliases as they are: each node is visited once, so a "billion laughs" file
// costs no more than its size.
func checkDocuments(b []byte, errs *errList) bool {
	dec := yamlnode.NewDecoder(bytes.NewReader(b))
	var doc yamlnode.Node
	if err := dec.Decode(&doc); err != nil {
		return true
	}
	ok := checkMergeKeys(&doc, "", errs)
	for {
		var next yamlnode.Node
		err := dec.Decode(&next)
		switch {
		case errors.Is(err, io.EOF):
			return ok
		case err != nil:
			errs.add("", strings.ReplaceAll(err.Error(), "\n", " ")+" (in a second YAML document: a drivers file holds exactly one)")
			return ok
		case !isEmptyDocument(&next):
			errs.add("", fmt.Sprintf("yaml: line %d: a second YAML document: a drivers file holds exactly one", next.Line))
			return ok
		}
	}
}

// isEmptyDocument reports whether a document holds nothing at all: "---" followed by nothing
// but comments, as opposed to an explicit "~" or "null".
func isEmptyDocument(doc *yamlnode.Node) bool {
	if len(doc.Content) != 1 {
		return len(doc.Content) == 0
	}
	n := doc.Content[0]
	return n.Kind == yamlnode.ScalarNode && n.Tag == "!!null" && n.Value == "" && n.Style == 0 && n.Anchor == ""
}

// checkMergeKeys reports every merge key under n, whose field path is path. It does not
// follow aliases.
func checkMergeKeys(n *yamlnode.Node, path string, errs *errList) bool {
	ok := true
	switch n.Kind {
	case yamlnode.DocumentNode:
		for _, c := range n.Content {
			ok = checkMergeKeys(c, path, errs) && ok
		}
	case yamlnode.SequenceNode:
		for i, c := range n.Content {
			ok = checkMergeKeys(c, fmt.Sprintf("%s[%d]", path, i), errs) && ok
		}
	case yamlnode.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if k.Kind == yamlnode.ScalarNode && k.Tag == "!!merge" {
				where := path
				if where == "" {
					where = "top level"
				}
				errs.add("", fmt.Sprintf(`%s: line %d: YAML merge keys ("<<") are not supported: write the fields out`, where, k.Line))
				ok = false
				continue
			}
			child := k.Value
			if path != "" {
				child = path + "." + k.Value
			}
			ok = checkMergeKeys(v, child, errs) && ok
		}
	}
	return ok
}
