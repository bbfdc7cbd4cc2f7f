package config

import (
	"encoding/base64"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
)

// The types below are the file format. The decoder is strict about them (KnownFields: an
// unknown field is an error; a key given twice is one), and each scalar type refuses a value
// of another YAML type. A nil pointer or slice is a field the file leaves out, so that resolve
// can tell it from an explicit value; a nil list element is a null one.

type file struct {
	APIVersion      str           `yaml:"apiVersion"`
	Kind            str           `yaml:"kind"`
	RegistrationDir str           `yaml:"registrationDir"`
	Defaults        settings      `yaml:"defaults"`
	Drivers         []*driverSpec `yaml:"drivers"`
}

// settings are the fields that defaults sets for every driver and a driver sets for itself.
type settings struct {
	Backoff             backoffSpec `yaml:"backoff"`
	RegistrationTimeout *duration   `yaml:"registrationTimeout"`
	WaitForEndpoint     *boolean    `yaml:"waitForEndpoint"`
}

type backoffSpec struct {
	InitialInterval     *duration `yaml:"initialInterval"`
	MaxInterval         *duration `yaml:"maxInterval"`
	Multiplier          *number   `yaml:"multiplier"`
	RandomizationFactor *number   `yaml:"randomizationFactor"`
}

type driverSpec struct {
	Name              str    `yaml:"name"`
	Type              str    `yaml:"type"`
	Endpoint          str    `yaml:"endpoint"`
	LocalEndpoint     str    `yaml:"localEndpoint"`
	SupportedVersions []*str `yaml:"supportedVersions"`
	SocketName        str    `yaml:"socketName"`
	settings          `yaml:",inline"`
}

// yamlFields lists the fields of a struct of the file format, each named as the file names it;
// an inline struct's fields count as the struct's own.
func yamlFields(t reflect.Type) []reflect.StructField {
	var fields []reflect.StructField
	for f := range t.Fields() {
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if opts == "inline" {
			fields = append(fields, yamlFields(f.Type)...)
			continue
		}
		f.Name = name
		fields = append(fields, f)
	}
	return fields
}

func fieldNames(t reflect.Type) []string {
	var names []string
	for _, f := range yamlFields(t) {
		names = append(names, f.Name)
	}
	return names
}

// topFields are the file's top-level fields, in the order the file format lists them.
var topFields = fieldNames(reflect.TypeFor[file]())

// str is a YAML string. A Go string field would also take a number or a boolean as its text
// (name: 123); str refuses them, and a string that is not UTF-8 (from !!binary).
type str string

func (s *str) UnmarshalYAML(n *yaml.Node) error {
	v, ok := stringValue(n)
	switch {
	case !ok:
		return wrongType(n, "a string")
	case !utf8.ValidString(v):
		return wrongType(n, "valid UTF-8")
	}
	*s = str(v)
	return nil
}

// boolean is true or false, or one of the YAML 1.1 words for them (yes, no, on, off, y, n),
// which drivers files have always accepted. A quoted "false" is a string.
type boolean bool

func (b *boolean) UnmarshalYAML(n *yaml.Node) error {
	v, ok := yaml11Bool(n)
	if !ok && n.ShortTag() == "!!bool" {
		ok = n.Decode(&v) == nil
	}
	if !ok {
		return wrongType(n, "true or false")
	}
	*b = boolean(v)
	return nil
}

// number is a finite number; a quoted "2" is a string.
type number float64

func (f *number) UnmarshalYAML(n *yaml.Node) error {
	v, ok := numberValue(n)
	switch {
	case !ok:
		return wrongType(n, "a number")
	case math.IsInf(v, 0) || math.IsNaN(v):
		return wrongType(n, "a finite number")
	}
	*f = number(v)
	return nil
}

// duration is a Go duration string ("500ms", "2m"). A bare 0 is zero in any unit; any other
// bare number lacks one (5 is not 5 seconds).
type duration time.Duration

func (d *duration) UnmarshalYAML(n *yaml.Node) error {
	if v, ok := numberValue(n); ok && v == 0 {
		*d = 0
		return nil
	}
	s, ok := stringValue(n)
	v, err := time.ParseDuration(s)
	if !ok || err != nil {
		return wrongType(n, `a duration such as "500ms" or "2m"`)
	}
	*d = duration(v)
	return nil
}

// wrongType is the error a scalar type returns for a value it refuses. The decoder collects
// it and goes on; locate finds the node again by its line and column, for the field path.
func wrongType(n *yaml.Node, want string) error {
	return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d: column %d: must be %s", n.Line, n.Column, want)}}
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

func numberValue(n *yaml.Node) (float64, bool) {
	var v float64
	t := n.ShortTag()
	return v, n.Kind == yaml.ScalarNode && (t == "!!int" || t == "!!float") && n.Decode(&v) == nil
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
