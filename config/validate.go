package config

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
	utilversion "k8s.io/apimachinery/pkg/util/version"
)

// resolve validates a decoded file and folds the defaults into every driver. It records every
// problem in errs and returns the resolved configuration, which is only meaningful when errs
// stays empty.
func resolve(f *file, errs *errList) *RegistrarConfig {
	checkConst(errs, "apiVersion", f.APIVersion, APIVersion)
	checkConst(errs, "kind", f.Kind, Kind)

	dir := DefaultRegistrationDir
	if f.RegistrationDir != "" {
		dir = filepath.Clean(f.RegistrationDir)
		switch {
		case !filepath.IsAbs(dir):
			errs.addf("registrationDir", f.RegistrationDir, "must be an absolute path")
		case strings.ContainsRune(dir, 0):
			errs.addf("registrationDir", f.RegistrationDir, "must not contain a NUL byte")
		case !kubeletCanDial(dir):
			errs.addValue("registrationDir", f.RegistrationDir, notDialable)
		case len(dir)+1+TempSocketNameLen > MaxSocketPathLen:
			errs.addf("registrationDir", f.RegistrationDir,
				"is %d bytes: a socket in it needs at least %d more, and a unix socket path is at most %d bytes",
				len(dir), 1+TempSocketNameLen, MaxSocketPathLen)
		}
	}

	builtin := Backoff{
		InitialInterval:     DefaultInitialInterval,
		MaxInterval:         DefaultMaxInterval,
		Multiplier:          DefaultMultiplier,
		RandomizationFactor: DefaultRandomizationFactor,
	}
	defBackoff := mergeBackoff(errs, "defaults.backoff", builtin, f.Defaults.Backoff)
	defTimeout := mergeTimeout(errs, "defaults.registrationTimeout", DefaultRegistrationTimeout, f.Defaults.RegistrationTimeout)
	defWait := DefaultWaitForEndpoint
	if f.Defaults.WaitForEndpoint != nil {
		defWait = *f.Defaults.WaitForEndpoint
	}

	// A file cut short after its header must not read as "no drivers": that would stop them all.
	if f.Drivers == nil {
		errs.add("drivers", `required: the list of drivers (write "drivers: []" for none)`)
	}

	cfg := &RegistrarConfig{RegistrationDir: dir, Drivers: make([]Driver, 0, len(f.Drivers))}
	byName := map[string]int{}
	bySocket := map[string]int{}
	for i, fd := range f.Drivers {
		p := fmt.Sprintf("drivers[%d]", i)
		d := Driver{
			Name:                fd.Name,
			Type:                fd.Type,
			Endpoint:            cleanPath(fd.Endpoint),
			LocalEndpoint:       cleanPath(fd.LocalEndpoint),
			SupportedVersions:   fd.SupportedVersions,
			SocketName:          fd.SocketName,
			Backoff:             mergeBackoff(errs, p+".backoff", defBackoff, fd.Backoff),
			RegistrationTimeout: mergeTimeout(errs, p+".registrationTimeout", defTimeout, fd.RegistrationTimeout),
			WaitForEndpoint:     defWait,
		}
		if fd.WaitForEndpoint != nil {
			d.WaitForEndpoint = *fd.WaitForEndpoint
		}

		typeOK := checkType(errs, p+".type", d.Type)
		if d.Name == "" {
			errs.add(p+".name", "required")
		} else if typeOK {
			checkName(errs, p+".name", d.Type, d.Name)
		}

		checkSocketPath(errs, p+".endpoint", fd.Endpoint, true, true)
		if d.LocalEndpoint == "" {
			d.LocalEndpoint = d.Endpoint
		} else {
			checkSocketPath(errs, p+".localEndpoint", fd.LocalEndpoint, false, false)
		}
		if fd.LocalEndpoint != "" || fd.Endpoint != "" {
			checkOutsideRegistry(errs, p, fd, d.LocalEndpoint, dir)
		}

		if d.SupportedVersions == nil {
			d.SupportedVersions = DefaultVersions(d.Type)
		} else if typeOK {
			checkVersions(errs, p+".supportedVersions", d.Type, d.SupportedVersions)
		}

		defaulted := d.SocketName == ""
		if defaulted {
			d.SocketName = DefaultSocketName(d.Name)
		} else {
			checkSocketName(errs, p+".socketName", d.SocketName)
		}
		d.SocketPath = filepath.Join(dir, d.SocketName)
		shown := formatValue(d.SocketName)
		if defaulted {
			shown += " (default)"
		}
		// A default name built from a missing name is already reported as "name: required".
		checkSocket := !defaulted || d.Name != ""
		if n := len(d.SocketPath); n > MaxSocketPathLen && checkSocket {
			errs.add(p+".socketName", fmt.Sprintf(
				"%s: socket path %q is %d bytes, more than the %d a unix socket path allows; set a shorter socketName or registrationDir",
				shown, d.SocketPath, n, MaxSocketPathLen))
		}

		if d.Name != "" {
			if j, dup := byName[d.Name]; dup {
				errs.addf(p+".name", d.Name, "duplicate of drivers[%d].name", j)
			} else {
				byName[d.Name] = i
			}
		}
		if j, dup := bySocket[d.SocketPath]; dup && checkSocket {
			errs.add(p+".socketName", fmt.Sprintf("%s: socket path %q is also used by drivers[%d] (%q)",
				shown, d.SocketPath, j, f.Drivers[j].Name))
		} else if !dup && checkSocket {
			bySocket[d.SocketPath] = i
		}
		cfg.Drivers = append(cfg.Drivers, d)
	}
	return cfg
}

func cleanPath(p string) string {
	if p == "" {
		return ""
	}
	return filepath.Clean(p)
}

func checkConst(errs *errList, path, got, want string) {
	switch got {
	case want:
	case "":
		errs.add(path, fmt.Sprintf("required: must be %q", want))
	default:
		errs.addf(path, got, "must be %q", want)
	}
}

func checkType(errs *errList, path, typ string) bool {
	if slices.Contains(Types, typ) {
		return true
	}
	if typ == "" {
		errs.add(path, "required: one of "+strings.Join(Types, ", "))
	} else {
		errs.addf(path, typ, "must be one of %s", strings.Join(Types, ", "))
	}
	return false
}

// checkName applies the rules kubelet and the API server apply to a plugin name of the type.
func checkName(errs *errList, path, typ, name string) {
	switch typ {
	case CSIPlugin, DRAPlugin:
		// The API server's ValidateCSIDriverName, used for CSINode entries and for DRA
		// driver names: at most 63 characters, a DNS subdomain when lowercased.
		if len(name) > 63 {
			errs.addf(path, name, "is %d characters, at most 63 are allowed", len(name))
		}
		for _, msg := range validation.IsDNS1123Subdomain(strings.ToLower(name)) {
			// Keep the rule, drop the example and regular expression that follow it.
			msg, _, _ = strings.Cut(msg, " (e.g.")
			errs.addf(path, name, "must be a DNS subdomain such as \"nfs.csi.k8s.io\": %s", msg)
		}
	case DevicePlugin:
		if !isExtendedResourceName(name) {
			errs.addf(path, name, "must be an extended resource name such as \"vendor.example/gpu\" (a domain prefix outside kubernetes.io, a '/', and a name)")
		}
	}
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
func checkVersions(errs *errList, path, typ string, versions []string) {
	if len(versions) == 0 {
		errs.add(path, "must not be empty (leave it out for the default)")
		return
	}
	switch typ {
	case CSIPlugin:
		// kubelet's CSI handler: the highest version of major 1 or lower, parsed with at
		// least two dotted parts, must be of major 1.
		if _, err := utilversion.HighestSupportedVersion(versions); err != nil {
			// kubelet's message ends in ": <nil>" when every entry parsed but none is 1.x.
			detail := strings.TrimSuffix(err.Error(), ": <nil>")
			errs.addf(path, versions, `kubelet would reject it: the highest version below 2 must be 1.x with at least two parts, such as "1.0.0" (kubelet: %s)`, detail)
		}
	case DRAPlugin:
		if !slices.Contains(versions, "v1.DRAPlugin") && !slices.Contains(versions, "v1beta1.DRAPlugin") {
			errs.addf(path, versions, `kubelet would reject it: must contain "v1.DRAPlugin" or "v1beta1.DRAPlugin"`)
		}
	case DevicePlugin:
		if !slices.Contains(versions, "v1beta1") {
			errs.addf(path, versions, `kubelet would reject it: must contain "v1beta1"`)
		}
	}
}

// notDialable is why a path kubelet dials may not hold some characters.
const notDialable = "kubelet cannot dial a path with '#', '?', '%' or a control character: its gRPC client reads the path as a URL"

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

// checkSocketPath checks an endpoint path: absolute and short enough to dial, and, when
// kubelet dials it, free of what kubelet would read as a URL.
func checkSocketPath(errs *errList, path, p string, required, kubeletDials bool) {
	switch {
	case p == "":
		if required {
			errs.add(path, "required: the absolute path of the plugin's socket")
		}
	case !filepath.IsAbs(p):
		errs.addf(path, p, "must be an absolute path")
	case len(filepath.Clean(p)) > MaxSocketPathLen:
		errs.addf(path, p, "is %d bytes, more than the %d a unix socket path allows", len(filepath.Clean(p)), MaxSocketPathLen)
	case strings.ContainsRune(p, 0):
		errs.addf(path, p, "must not contain a NUL byte")
	case kubeletDials && !kubeletCanDial(p):
		errs.addValue(path, p, notDialable)
	}
}

// checkOutsideRegistry refuses an endpoint inside the registration directory: kubelet would
// take the plugin's own socket for a registration socket and retry it forever.
func checkOutsideRegistry(errs *errList, p string, fd fileDriver, local, dir string) {
	if !filepath.IsAbs(local) {
		return
	}
	rel, err := filepath.Rel(dir, local)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return
	}
	for _, elem := range strings.Split(rel, string(filepath.Separator)) {
		if strings.HasPrefix(elem, ".") {
			return // kubelet ignores hidden names
		}
	}
	field, value := p+".endpoint", fd.Endpoint
	if fd.LocalEndpoint != "" {
		field, value = p+".localEndpoint", fd.LocalEndpoint
	}
	errs.addf(field, value, "is inside registrationDir %q: kubelet would take the plugin's socket for a registration socket", dir)
}

func checkSocketName(errs *errList, path, name string) {
	switch {
	case strings.ContainsRune(name, '/'):
		errs.addf(path, name, "must be a file name, without '/'")
	case strings.HasPrefix(name, "."):
		errs.addf(path, name, "must not start with '.': kubelet ignores hidden files")
	case strings.ContainsRune(name, 0):
		errs.addf(path, name, "must not contain a NUL byte")
	case !kubeletCanDial(name):
		errs.addValue(path, name, notDialable)
	}
}

// mergeBackoff validates the fields set in spec and applies them over base.
func mergeBackoff(errs *errList, path string, base Backoff, spec fileBackoff) Backoff {
	b := base
	if spec.InitialInterval != nil {
		b.InitialInterval = time.Duration(*spec.InitialInterval)
		checkInterval(errs, path+".initialInterval", b.InitialInterval)
	}
	if spec.MaxInterval != nil {
		b.MaxInterval = time.Duration(*spec.MaxInterval)
		checkInterval(errs, path+".maxInterval", b.MaxInterval)
	}
	if spec.Multiplier != nil {
		b.Multiplier = *spec.Multiplier
		if b.Multiplier < 1 {
			errs.addValue(path+".multiplier", b.Multiplier, "must be at least 1")
		}
	}
	if spec.RandomizationFactor != nil {
		b.RandomizationFactor = *spec.RandomizationFactor
		if b.RandomizationFactor < 0 || b.RandomizationFactor > 1 {
			errs.addValue(path+".randomizationFactor", b.RandomizationFactor, "must be between 0 and 1")
		}
	}
	if (spec.InitialInterval != nil || spec.MaxInterval != nil) &&
		b.InitialInterval > 0 && b.MaxInterval > 0 && b.MaxInterval < b.InitialInterval {
		errs.addValue(path+".maxInterval", b.MaxInterval,
			fmt.Sprintf("must not be less than initialInterval (%s)", b.InitialInterval))
	}
	return b
}

// checkInterval refuses a backoff interval that is not positive, or so short that retries
// would spin a core.
func checkInterval(errs *errList, path string, d time.Duration) {
	switch {
	case d <= 0:
		errs.addValue(path, d, "must be positive")
	case d < MinInterval:
		errs.addValue(path, d, "must be at least "+MinInterval.String())
	}
}

// mergeTimeout validates a registrationTimeout if set and returns it, or base.
func mergeTimeout(errs *errList, path string, base time.Duration, spec *duration) time.Duration {
	if spec == nil {
		return base
	}
	t := time.Duration(*spec)
	switch {
	case t < 0:
		errs.addValue(path, t, "must not be negative (0 disables the timeout)")
	case t > 0 && t < time.Second:
		errs.addValue(path, t, "must be 0 (disabled) or at least 1s: kubelet looks for new sockets once a second")
	}
	return t
}
