package config

import (
	"fmt"
	"path/filepath"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// patternMeta are the characters that make an endpoint's last element a pattern: '*' (any
// run of characters) and '?' (any one character), as path/filepath.Match reads them. The rest
// of that syntax, '[' classes and '\' quotes, is refused in a pattern, so that a name holding
// '[' or '\' without '*' or '?' means what it meant before patterns: itself.
const patternMeta = "*?"

// IsPattern reports whether the last element of an endpoint path is a pattern.
func IsPattern(path string) bool {
	return strings.ContainsAny(filepath.Base(path), patternMeta)
}

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

// RollsOver reports whether the driver's registration may roll over from one instance of its
// endpoint to the next through a second registration socket, AltSocketName: a DRA driver or a
// device plugin whose endpoint is a pattern. The new instance is then registered before the
// old one's registration is withdrawn, and kubelet never holds none:
//   - kubelet keeps several instances of one DRA driver, each with its own endpoint, and uses
//     the newest: a DRA driver always rolls over (AlwaysRollsOver).
//   - kubelet 1.37 and later keep several endpoints of one device plugin, keyed by their
//     socket, and promote a remaining one when one goes; older ones keep one per resource
//     name, and a second registration replaces the first. A device plugin rolls over only on
//     a kubelet that keeps several (the registrar tells which kubelet it serves); otherwise it
//     is registered again under the new endpoint, as a CSI driver always is.
func (d Driver) RollsOver() bool {
	return (d.Type == DRAPlugin || d.Type == DevicePlugin) && d.EndpointIsPattern()
}

// AlwaysRollsOver reports whether the driver rolls over whatever kubelet it serves: a DRA
// driver whose endpoint is a pattern.
func (d Driver) AlwaysRollsOver() bool { return d.Type == DRAPlugin && d.EndpointIsPattern() }

// SpareSocketName is the third registration socket's name of a device plugin whose endpoint is
// a pattern: socketName with ".2" before ".sock", or after the name when it does not end in
// ".sock".
func SpareSocketName(socketName string) string {
	if stem, ok := strings.CutSuffix(socketName, ".sock"); ok {
		return stem + ".2.sock"
	}
	return socketName + ".2"
}

// AltSocketName is the second registration socket's name of a driver that rolls its
// registration over (RollsOver): socketName with ".1" before ".sock" ("gpu.example.com-reg.1.sock"), or
// after the name when it does not end in ".sock".
func AltSocketName(socketName string) string {
	if stem, ok := strings.CutSuffix(socketName, ".sock"); ok {
		return stem + ".1.sock"
	}
	return socketName + ".1"
}

// checkPattern checks an endpoint (kubelet's path) with '*' in a directory or a pattern in its
// last element: a pattern only there, of '*' and '?' only, with a character of its own, and
// room under the socket path limit for the shortest name it matches.
func checkPattern(p *field.Path, path string) field.ErrorList {
	clean := filepath.Clean(path)
	dir, base := filepath.Dir(clean), filepath.Base(clean)
	var msg string
	shortest := len(base) - strings.Count(base, "*") // '*' may match nothing, '?' one byte
	switch {
	case strings.ContainsAny(dir, "*"):
		msg = fmt.Sprintf("a pattern is allowed only in the last element (the socket's name), not in %q", dir)
	case strings.ContainsAny(base, "[\\"):
		msg = fmt.Sprintf("the pattern %q holds '[' or '\\': a pattern is made of '*' (any characters) and '?' (any one character) only", base)
	case strings.Trim(base, "*?") == "":
		msg = fmt.Sprintf("the pattern %q has no character of its own and matches other files of the directory: name the driver's sockets, such as \"dra-*.sock\"", base)
	case len(dir)+1+shortest > MaxSocketPathLen:
		msg = fmt.Sprintf("leaves no room for a socket name: the shortest path the pattern matches is %d bytes, and a unix socket path is at most %d",
			len(dir)+1+shortest, MaxSocketPathLen)
	case strings.ContainsRune(path, 0):
		msg = "must not contain a NUL byte"
	case !kubeletCanDial(dir) || !kubeletCanDial(strings.ReplaceAll(base, "?", "")):
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
