package config

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilversion "k8s.io/apimachinery/pkg/util/version"
)

// resolve checks a decoded file and fills in what each driver leaves out. It returns the
// resolved configuration, which is only meaningful when there is no problem, and every problem.
// look, when not nil, is how it sees a path of this machine (os.Stat): only the check of
// device plugins' directories uses it.
func resolve(f *file, look func(string) (fs.FileInfo, error)) (*RegistrarConfig, field.ErrorList) {
	errs := checkConst(field.NewPath("apiVersion"), f.APIVersion, APIVersion)
	errs = append(errs, checkConst(field.NewPath("kind"), f.Kind, Kind)...)
	dir, dirErrs := registrationDir(field.NewPath("registrationDir"), f.RegistrationDir)
	errs = append(errs, dirErrs...)

	// A file cut short after its header must not read as "no drivers": that would stop them all.
	if f.Drivers == nil {
		errs = append(errs, field.Required(field.NewPath("drivers"), `the list of drivers (write "drivers: []" for none)`))
	}

	cfg := &RegistrarConfig{RegistrationDir: dir, Drivers: f.Drivers}
	dpDirs := devicePluginDirs(dir, look)
	byName := map[string]int{}
	bySocket := map[string]int{}
	for i := range cfg.Drivers {
		d, p := &cfg.Drivers[i], field.NewPath("drivers").Index(i)
		// The socket name as messages show it. A default one built from a missing name is
		// not checked: "name: required" says it already.
		shown, checkSocket := formatValue(d.SocketName), d.SocketName != "" || d.Name != ""
		if d.SocketName == "" {
			shown = formatValue(DefaultSocketName(d.Name)) + " (default)"
		}
		errs = append(errs, d.resolve(p, dir, dpDirs, look)...)
		for _, sp := range d.SocketPaths() {
			if n := len(sp); n > MaxSocketPathLen && checkSocket {
				errs = append(errs, field.Invalid(p.Child("socketName"), omit, fmt.Sprintf(
					"%s: socket path %q is %d bytes, more than the %d a unix socket path allows; set a shorter socketName or registrationDir",
					shown, sp, n, MaxSocketPathLen)))
			}
		}
		if j, dup := byName[d.Name]; dup {
			e := field.Duplicate(p.Child("name"), d.Name)
			e.Detail = fmt.Sprintf("duplicate of drivers[%d].name", j)
			errs = append(errs, e)
		} else if d.Name != "" {
			byName[d.Name] = i
		}
		clashed := map[int]bool{} // one error for each other driver, at its first shared path
		for _, sp := range d.SocketPaths() {
			if j, dup := bySocket[sp]; dup && checkSocket {
				if clashed[j] {
					continue
				}
				clashed[j] = true
				errs = append(errs, field.Invalid(p.Child("socketName"), omit, fmt.Sprintf("%s: socket path %q is also used by drivers[%d] (%q)",
					shown, sp, j, cfg.Drivers[j].Name)))
			} else if checkSocket {
				bySocket[sp] = i
			}
		}
	}
	return cfg, errs
}

// resolve checks what the driver sets itself, as written, and fills in the rest. dpDirs and
// look are for checkDevicePluginDir.
func (d *Driver) resolve(p *field.Path, dir string, dpDirs []devicePluginDir, look func(string) (fs.FileInfo, error)) field.ErrorList {
	var errs field.ErrorList
	typeOK := slices.Contains(Types, d.Type)
	switch {
	case d.Type == "":
		errs = append(errs, field.Required(p.Child("type"), "one of "+strings.Join(Types, ", ")))
	case !typeOK:
		errs = append(errs, field.Invalid(p.Child("type"), d.Type, "must be one of "+strings.Join(Types, ", ")))
	}
	if d.Name == "" {
		errs = append(errs, field.Required(p.Child("name"), ""))
	} else if typeOK {
		errs = append(errs, checkName(p.Child("name"), d.Type, d.Name)...)
	}

	errs = append(errs, checkEndpoint(p.Child("endpoint"), d.Endpoint, true, true)...)
	errs = append(errs, checkEndpoint(p.Child("localEndpoint"), d.LocalEndpoint, false, false)...)
	errs = append(errs, d.checkPatterns(p)...)
	if IsPattern(d.Endpoint) && !d.WaitForEndpoint {
		errs = append(errs, field.Invalid(p.Child("waitForEndpoint"), false,
			"must be true when endpoint is a pattern: multireg looks for the matching socket that answers to tell kubelet its path"))
	}
	errs = append(errs, d.checkOutsideRegistry(p, dir)...)
	errs = append(errs, d.checkDevicePluginDir(p, dpDirs, look)...)
	if d.LocalEndpoint == "" {
		d.LocalEndpoint = d.Endpoint
	}
	d.Endpoint, d.LocalEndpoint = filepath.Clean(d.Endpoint), filepath.Clean(d.LocalEndpoint)

	if d.SupportedVersions == nil {
		d.SupportedVersions = DefaultVersions(d.Type)
	} else if typeOK {
		errs = append(errs, checkVersions(p.Child("supportedVersions"), d.Type, d.SupportedVersions)...)
	}

	if d.SocketName == "" {
		d.SocketName = DefaultSocketName(d.Name)
	} else {
		errs = append(errs, checkSocketName(p.Child("socketName"), d.SocketName)...)
	}
	d.SetSocketPaths(dir)
	return errs
}

func checkConst(p *field.Path, got, want string) field.ErrorList {
	switch got {
	case want:
		return nil
	case "":
		return field.ErrorList{field.Required(p, fmt.Sprintf("must be %q", want))}
	}
	return field.ErrorList{field.Invalid(p, got, fmt.Sprintf("must be %q", want))}
}

// registrationDir returns the directory the file names, cleaned, or the default.
func registrationDir(p *field.Path, raw string) (string, field.ErrorList) {
	if raw == "" {
		return DefaultRegistrationDir, nil
	}
	dir := filepath.Clean(raw)
	switch {
	case !filepath.IsAbs(dir):
		return dir, field.ErrorList{field.Invalid(p, raw, "must be an absolute path")}
	case strings.ContainsRune(dir, 0):
		return dir, field.ErrorList{field.Invalid(p, raw, "must not contain a NUL byte")}
	case !kubeletCanDial(dir):
		return dir, field.ErrorList{field.Invalid(p, raw, notDialable)}
	case len(dir)+1+TempSocketNameLen > MaxSocketPathLen:
		return dir, field.ErrorList{field.Invalid(p, raw, fmt.Sprintf(
			"is %d bytes: a socket in it needs at least %d more, and a unix socket path is at most %d bytes",
			len(dir), 1+TempSocketNameLen, MaxSocketPathLen))}
	}
	return dir, nil
}

// checkName applies the rules kubelet and the API server apply to a plugin name of the type.
func checkName(p *field.Path, typ, name string) field.ErrorList {
	var errs field.ErrorList
	switch typ {
	case CSIPlugin, DRAPlugin:
		// The API server's ValidateCSIDriverName, used for CSINode entries and for DRA
		// driver names: at most 63 characters, a DNS subdomain when lowercased.
		if len(name) > 63 {
			errs = append(errs, field.Invalid(p, name, fmt.Sprintf("is %d characters, at most 63 are allowed", len(name))))
		}
		for _, msg := range validation.IsDNS1123Subdomain(strings.ToLower(name)) {
			// Keep the rule, drop the example and regular expression that follow it.
			msg, _, _ = strings.Cut(msg, " (e.g.")
			errs = append(errs, field.Invalid(p, name, `must be a DNS subdomain such as "nfs.csi.k8s.io": `+msg))
		}
	case DevicePlugin:
		if !isExtendedResourceName(name) {
			errs = append(errs, field.Invalid(p, name, `must be an extended resource name such as "vendor.example/gpu" (a domain prefix outside kubernetes.io, a '/', and a name)`))
		}
	}
	return errs
}

// isExtendedResourceName is kubelet's check for a device plugin's name
// (pkg/apis/core/v1/helper.IsExtendedResourceName): a prefixed name outside the
// kubernetes.io namespace that stays a qualified name once "requests." is put in front.
func isExtendedResourceName(name string) bool {
	if !strings.Contains(name, "/") || strings.Contains(name, "kubernetes.io/") || strings.HasPrefix(name, "requests.") {
		return false
	}
	return len(validation.IsQualifiedName("requests."+name)) == 0
}

// checkVersions applies the version checks of kubelet's handler for the type.
func checkVersions(p *field.Path, typ string, versions []string) field.ErrorList {
	if len(versions) == 0 {
		return field.ErrorList{field.Invalid(p, omit, "must not be empty (leave it out for the default)")}
	}
	const reject = "kubelet would reject it: "
	switch typ {
	case CSIPlugin:
		// kubelet's CSI handler: the highest version of major 1 or lower, parsed with at
		// least two dotted parts, must be of major 1.
		if _, err := utilversion.HighestSupportedVersion(versions); err != nil {
			// kubelet's message ends in ": <nil>" when every entry parsed but none is 1.x.
			detail := strings.TrimSuffix(err.Error(), ": <nil>")
			return field.ErrorList{field.Invalid(p, versions, reject+`the highest version below 2 must be 1.x with at least two parts, such as "1.0.0" (kubelet: `+detail+")")}
		}
	case DRAPlugin:
		if !slices.Contains(versions, "v1.DRAPlugin") && !slices.Contains(versions, "v1beta1.DRAPlugin") {
			return field.ErrorList{field.Invalid(p, versions, reject+`must contain "v1.DRAPlugin" or "v1beta1.DRAPlugin"`)}
		}
	case DevicePlugin:
		if !slices.Contains(versions, "v1beta1") {
			return field.ErrorList{field.Invalid(p, versions, reject+`must contain "v1beta1"`)}
		}
	}
	return nil
}

// notDialable is why a path kubelet dials may not hold some characters.
const notDialable = "kubelet cannot dial a path with '#', '?', '%' or a control character: its gRPC client reads the path as a URL"

// KubeletCanDial reports whether kubelet can dial a unix socket at p (see kubeletCanDial): a
// socket that matches an endpoint pattern is registered only when it can.
func KubeletCanDial(p string) bool { return kubeletCanDial(p) }

// kubeletCanDial reports whether kubelet can dial a unix socket at p. kubelet hands the path
// to gRPC as a target, which parses it as a URL: '#' and '?' cut it short, '%' escapes are
// decoded (or fail to parse), and a control character fails to parse. multireg dials paths
// without a URL (localEndpoint may hold any byte but NUL); endpoint, registrationDir and
// socketName are dialled by kubelet.
func kubeletCanDial(p string) bool {
	return !strings.ContainsFunc(p, func(r rune) bool {
		return r == '#' || r == '?' || r == '%' || r < 0x20 || r == 0x7f
	})
}

// checkEndpoint checks an endpoint path: absolute and short enough to dial, and, when
// kubelet dials it, free of what kubelet would read as a URL.
func checkEndpoint(p *field.Path, path string, required, kubeletDials bool) field.ErrorList {
	var msg string
	switch {
	case path == "" && required:
		return field.ErrorList{field.Required(p, "the absolute path of the plugin's socket")}
	case path == "":
		return nil
	case kubeletDials && filepath.IsAbs(path) && (IsPattern(path) || strings.Contains(filepath.Dir(path), "*")):
		return checkPattern(p, path)
	case !filepath.IsAbs(path):
		msg = "must be an absolute path"
	case len(filepath.Clean(path)) > MaxSocketPathLen:
		msg = fmt.Sprintf("is %d bytes, more than the %d a unix socket path allows", len(filepath.Clean(path)), MaxSocketPathLen)
	case strings.ContainsRune(path, 0):
		msg = "must not contain a NUL byte"
	case kubeletDials && !kubeletCanDial(path):
		msg = notDialable
	default:
		return nil
	}
	return field.ErrorList{field.Invalid(p, path, msg)}
}

// checkOutsideRegistry refuses an endpoint inside the registration directory: kubelet would
// take the plugin's own socket for a registration socket and retry it forever.
func (d *Driver) checkOutsideRegistry(p *field.Path, dir string) field.ErrorList {
	fp, value := p.Child("endpoint"), d.Endpoint
	if d.LocalEndpoint != "" {
		fp, value = p.Child("localEndpoint"), d.LocalEndpoint
	}
	local := filepath.Clean(value)
	if !filepath.IsAbs(local) {
		return nil
	}
	rel, err := filepath.Rel(dir, local)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return nil
	}
	for elem := range strings.SplitSeq(rel, string(filepath.Separator)) {
		if strings.HasPrefix(elem, ".") {
			return nil // kubelet ignores hidden names
		}
	}
	return field.ErrorList{field.Invalid(fp, value, fmt.Sprintf("is inside registrationDir %q: kubelet would take the plugin's socket for a registration socket", dir))}
}

func checkSocketName(p *field.Path, name string) field.ErrorList {
	var msg string
	switch {
	case strings.ContainsRune(name, '/'):
		msg = "must be a file name, without '/'"
	case strings.HasPrefix(name, "."):
		msg = "must not start with '.': kubelet ignores hidden files"
	case strings.ContainsRune(name, 0):
		msg = "must not contain a NUL byte"
	case !kubeletCanDial(name):
		msg = notDialable
	default:
		return nil
	}
	return field.ErrorList{field.Invalid(p, name, msg)}
}
