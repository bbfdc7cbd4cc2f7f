package config

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v2"
)

// The file types mirror the YAML document as written. Pointers and nil slices mean "not set",
// so that resolve can tell an explicit value from an absent one.

type file struct {
	APIVersion      string       `json:"apiVersion"`
	Kind            string       `json:"kind"`
	RegistrationDir string       `json:"registrationDir"`
	Defaults        fileDefaults `json:"defaults"`
	Drivers         []fileDriver `json:"drivers"`
}

type fileDefaults struct {
	Backoff             fileBackoff `json:"backoff"`
	RegistrationTimeout *duration   `json:"registrationTimeout"`
	WaitForEndpoint     *bool       `json:"waitForEndpoint"`
}

type fileBackoff struct {
	InitialInterval     *duration `json:"initialInterval"`
	MaxInterval         *duration `json:"maxInterval"`
	Multiplier          *float64  `json:"multiplier"`
	RandomizationFactor *float64  `json:"randomizationFactor"`
}

type fileDriver struct {
	Name                string      `json:"name"`
	Type                string      `json:"type"`
	Endpoint            string      `json:"endpoint"`
	LocalEndpoint       string      `json:"localEndpoint"`
	SupportedVersions   []string    `json:"supportedVersions"`
	SocketName          string      `json:"socketName"`
	Backoff             fileBackoff `json:"backoff"`
	RegistrationTimeout *duration   `json:"registrationTimeout"`
	WaitForEndpoint     *bool       `json:"waitForEndpoint"`
}

// duration is a Go duration string in the file ("500ms", "2m").
type duration time.Duration

var durationType = reflect.TypeFor[duration]()

// decode turns YAML into a file, strictly: YAML syntax errors and duplicate keys (with their
// line), a second document, merge keys, unknown fields and wrong types are all reported, each
// with its field path. Decoding goes on past a bad field so that one pass reports every problem.
func decode(b []byte, errs *errList) *file {
	if !checkDocuments(b, errs) {
		return nil
	}
	var tree any
	if err := yaml.UnmarshalStrict(b, &tree); err != nil {
		errs.addYAML(err)
		return nil
	}
	tree = stringKeys(tree)
	if tree == nil {
		errs.add("", "the file is empty")
		return nil
	}
	if _, ok := tree.(map[string]any); !ok {
		errs.decodeFailed("", tree, "must be a mapping with apiVersion, kind and drivers")
		return nil
	}
	var f file
	decodeValue(reflect.ValueOf(&f).Elem(), tree, "", errs)
	return &f
}

// stringKeys returns the decoded YAML value in with every mapping's keys turned into strings,
// as JSON would have them: a key such as 1 or true can only be an unknown field.
func stringKeys(in any) any {
	switch x := in.(type) {
	case map[any]any:
		m := make(map[string]any, len(x))
		for k, v := range x {
			m[keyString(k)] = stringKeys(v)
		}
		return m
	case []any:
		for i, v := range x {
			x[i] = stringKeys(v)
		}
	}
	return in
}

func keyString(k any) string {
	switch k := k.(type) {
	case string:
		return k
	case float64:
		return formatFloat(k)
	case nil:
		return "null"
	}
	return fmt.Sprint(k)
}

// decodeValue stores in into v, which is addressable. A null leaves v at its zero value.
func decodeValue(v reflect.Value, in any, path string, errs *errList) {
	if in == nil {
		return
	}
	typeErr := func(want string) {
		errs.decodeFailed(path, in, "must be "+want)
	}
	if v.Type() == durationType {
		s, ok := in.(string)
		if n, isNumber := number(in); isNumber && n == 0 {
			s, ok = "0", true // a bare 0 is zero in any unit; other numbers lack one
		}
		d, err := time.ParseDuration(s)
		if !ok || err != nil {
			typeErr(`a duration such as "500ms" or "2m"`)
			return
		}
		v.SetInt(int64(d))
		return
	}
	switch v.Kind() {
	case reflect.Pointer:
		p := reflect.New(v.Type().Elem())
		decodeValue(p.Elem(), in, path, errs)
		v.Set(p)
	case reflect.String:
		s, ok := in.(string)
		if !ok {
			typeErr("a string")
			return
		}
		if !utf8.ValidString(s) {
			typeErr("valid UTF-8")
			return
		}
		v.SetString(s)
	case reflect.Bool:
		b, ok := in.(bool)
		if !ok {
			typeErr("true or false")
			return
		}
		v.SetBool(b)
	case reflect.Float64:
		n, ok := number(in)
		if !ok {
			typeErr("a number")
			return
		}
		if math.IsInf(n, 0) || math.IsNaN(n) {
			typeErr("a finite number")
			return
		}
		v.SetFloat(n)
	case reflect.Slice:
		list, ok := in.([]any)
		if !ok {
			typeErr("a list")
			return
		}
		s := reflect.MakeSlice(v.Type(), len(list), len(list))
		for i, item := range list {
			decodeValue(s.Index(i), item, fmt.Sprintf("%s[%d]", path, i), errs)
		}
		v.Set(s)
	case reflect.Struct:
		m, ok := in.(map[string]any)
		if !ok {
			typeErr("a mapping")
			return
		}
		fields := map[string]int{}
		var names []string
		for i := range v.NumField() {
			name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("json"), ",")
			fields[name] = i
			names = append(names, name)
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			child := k
			if path != "" {
				child = path + "." + k
			}
			i, ok := fields[k]
			if !ok {
				msg := "unknown field"
				if s := suggest(k, names); s != "" {
					msg += fmt.Sprintf(" (did you mean %q?)", s)
				}
				errs.add(child, msg)
				continue
			}
			decodeValue(v.Field(i), m[k], child, errs)
		}
	default:
		panic(fmt.Sprintf("config: no decoder for %s", v.Type()))
	}
}

// number returns a decoded YAML number as a float64. YAML decodes an integer as int, int64
// or uint64, by size.
func number(in any) (float64, bool) {
	switch x := in.(type) {
	case int:
		return float64(x), true
	case int64:
		return float64(x), true
	case uint64:
		return float64(x), true
	case float64:
		return x, true
	}
	return 0, false
}

// formatValue renders a decoded YAML value for an error message.
func formatValue(in any) string {
	switch x := in.(type) {
	case string:
		return strconv.Quote(x)
	case float64:
		return formatFloat(x)
	case time.Duration:
		return x.String()
	}
	b, err := json.Marshal(in)
	if err != nil {
		return fmt.Sprint(in)
	}
	if len(b) > 60 {
		return string(b[:57]) + "..."
	}
	return string(b)
}

// formatFloat renders a number; infinities and NaN as YAML writes them.
func formatFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return ".inf"
	case math.IsInf(f, -1):
		return "-.inf"
	case math.IsNaN(f):
		return ".nan"
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// suggest returns the known field closest to an unknown one, if it is a likely typo.
func suggest(unknown string, known []string) string {
	best, bestDist := "", 3
	for _, k := range known {
		if strings.EqualFold(k, unknown) {
			return k
		}
		if d := editDistance(strings.ToLower(unknown), strings.ToLower(k)); d < bestDist {
			best, bestDist = k, d
		}
	}
	return best
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
