package config

import (
	"fmt"
	"path/filepath"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// patternMeta are the characters that make an endpoint's last element a pattern, in the
// syntax of path/filepath.Match.
const patternMeta = `*?[\`

// IsPattern reports whether the last element of an endpoint path is a pattern.
func IsPattern(path string) bool {
	return strings.ContainsAny(filepath.Base(path), patternMeta)
}

// dirPatternMeta are the pattern characters refused in an endpoint's directories: a pattern
// there was meant as one, and only the last element may be one. ('?' cannot be dialled
// anyway; '\' is left alone, a byte some directories may hold.)
const dirPatternMeta = "*["

// EndpointIsPattern reports whether the driver's endpoint names its socket by a pattern: a
// driver whose socket gets a new name each time it starts (a DRA driver in rolling-update
// mode, "dra-<pod uid>.sock"; a device plugin's "dp.<unix time>").
// The endpoint decides: localEndpoint then ends in the same pattern, and is otherwise taken
// as it is written (it may hold any byte but NUL).
func (d Driver) EndpointIsPattern() bool { return IsPattern(d.Endpoint) }

// Concrete returns the endpoint path kubelet dials and the one this process dials for the
// socket named name, a match of the driver's endpoint pattern. A driver without a pattern
// returns its own endpoints.
func (d Driver) Concrete(name string) (endpoint, local string) {
	if !d.EndpointIsPattern() {
		return d.Endpoint, d.LocalEndpoint
	}
	return filepath.Join(filepath.Dir(d.Endpoint), name), filepath.Join(filepath.Dir(d.LocalEndpoint), name)
}

// Handover reports whether the driver's registration is handed from one instance of its
// endpoint to the next through a second registration socket, AltSocketName: a DRA driver
// whose endpoint is a pattern. kubelet keeps several instances of one DRA driver, each with
// its own endpoint, and uses the newest: the new instance is registered before the old one is
// withdrawn, and kubelet never holds none. kubelet keeps one registration of a CSI driver or a
// device plugin per name, so those are registered again under the new endpoint.
func (d Driver) Handover() bool { return d.Type == DRAPlugin && d.EndpointIsPattern() }

// AltSocketName is the second registration socket's name of a driver that hands its
// registration over: socketName with ".1" before ".sock" ("gpu.example.com-reg.1.sock"), or
// after the name when it does not end in ".sock".
func AltSocketName(socketName string) string {
	if stem, ok := strings.CutSuffix(socketName, ".sock"); ok {
		return stem + ".1.sock"
	}
	return socketName + ".1"
}

// checkPattern checks an endpoint (kubelet's path) whose last element is a pattern: a pattern only there, one
// path/filepath.Match accepts, and room under the socket path limit for a name it matches.
// checkEndpoint calls it for an absolute endpoint with a pattern anywhere.
func checkPattern(p *field.Path, path string) field.ErrorList {
	clean := filepath.Clean(path)
	dir, base := filepath.Dir(clean), filepath.Base(clean)
	var msg string
	_, badPattern := filepath.Match(base, "")
	// The shortest name the pattern can match: its fixed characters, one per '?' or class.
	fixed := strings.NewReplacer("*", "", "\\", "").Replace(base)
	switch {
	case strings.ContainsAny(dir, dirPatternMeta):
		msg = fmt.Sprintf("a pattern is allowed only in the last element (the socket's name), not in %q", dir)
	case badPattern != nil:
		msg = fmt.Sprintf("the pattern %q is malformed (the syntax of Go's path/filepath.Match: '*', '?', '[...]', '\\')", base)
	case base == "*":
		msg = "the pattern \"*\" matches every file of the directory: name the driver's sockets, such as \"dra-*.sock\""
	case len(dir)+1+len(fixed) > MaxSocketPathLen:
		msg = fmt.Sprintf("leaves no room for a socket name: the directory and the pattern's fixed part are %d bytes, and a unix socket path is at most %d",
			len(dir)+1+len(fixed), MaxSocketPathLen)
	case strings.ContainsRune(path, 0):
		msg = "must not contain a NUL byte"
	case !kubeletCanDial(strings.ReplaceAll(path, "?", "")):
		msg = notDialable
	default:
		return nil
	}
	return field.ErrorList{field.Invalid(p, path, msg)}
}

// checkPatterns checks that localEndpoint ends in endpoint's pattern, if endpoint has one:
// both name the same file, seen from kubelet and from this process.
func (d *Driver) checkPatterns(p *field.Path) field.ErrorList {
	if d.LocalEndpoint == "" || !IsPattern(d.Endpoint) || filepath.Base(filepath.Clean(d.Endpoint)) == filepath.Base(filepath.Clean(d.LocalEndpoint)) {
		return nil
	}
	return field.ErrorList{field.Invalid(p.Child("localEndpoint"), d.LocalEndpoint,
		fmt.Sprintf("must end in the same pattern as endpoint (%q): both name the driver's socket, from kubelet and from multireg", filepath.Base(d.Endpoint)))}
}
