package config

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// KubeletDevicePluginDir is kubelet's device-plugin directory (k8s.io/kubelet's
// deviceplugin/v1beta1 DevicePluginPath): where kubelet.sock serves the device-plugin API's
// own Register call, the only directory a plugin registering itself that way can name its
// endpoint in, and where kubelet removes every socket when it starts. kubelet's --root-dir
// does not move it: a kubelet rooted in /var/lib/k0s/kubelet still uses this one.
const KubeletDevicePluginDir = "/var/lib/kubelet/device-plugins"

// A device plugin whose endpoint is in kubelet's device-plugin directory is refused: it is a
// plugin that registers itself through kubelet.sock, or one whose socket kubelet removes at
// every start. kubelet 1.37 refuses a second registration of one (resource, endpoint) while
// the first is connected, and that refusal drops kubelet's record of the connected one: the
// endpoint is refused until kubelet restarts, and the resource's devices stay advertised after
// the plugin is gone. Older kubelets replace the plugin's own registration with multireg's,
// and drop the resource when either goes.
//
// The directories refused, each by name, and by identity where this machine shows both:
//   - KubeletDevicePluginDir, whatever registrationDir is;
//   - <root>/device-plugins, when registrationDir is <root>/plugins_registry of another root.
//     kubelet does not use it by itself, but a node with another root may link its
//     /var/lib/kubelet and that root together (so that tools that assume the default root
//     work), which makes the two one directory; a pod sees no such link. A
//     plugin registered by multireg never needs to be there: <root>/plugins is its place.
//     A registrationDir of another name tells no root: only KubeletDevicePluginDir is refused.
//
// By identity (ParseLocal only): the endpoint's directory as multireg sees it (localEndpoint's,
// else endpoint's) is refused when it is, through a symlink or a mount, the same directory as
// one of those as multireg sees them. A path that does not exist is compared by name only.

// devicePluginDir is a directory a device plugin's endpoint must not be in.
type devicePluginDir struct {
	path string
	// root is the kubelet root registrationDir names (<root>/plugins_registry), "" for none:
	// the message points at <root>/plugins.
	root string
	// derived: the directory is <root>/device-plugins, not kubelet's own.
	derived bool
	// fi is the directory as this process sees it, nil when not looked at or not there.
	fi fs.FileInfo
}

// devicePluginDirs returns the directories no device plugin's endpoint may be in, for the
// registration directory dir (cleaned). With look, each is looked at as this process sees it.
func devicePluginDirs(dir string, look func(string) (fs.FileInfo, error)) []devicePluginDir {
	root := ""
	if filepath.Base(dir) == "plugins_registry" {
		root = filepath.Dir(dir)
	}
	dirs := []devicePluginDir{{path: KubeletDevicePluginDir, root: root}}
	if derived := filepath.Join(root, "device-plugins"); root != "" && derived != KubeletDevicePluginDir {
		dirs = append(dirs, devicePluginDir{path: derived, root: root, derived: true})
	}
	for i := range dirs {
		if look != nil {
			if fi, err := look(dirs[i].path); err == nil && fi.IsDir() {
				dirs[i].fi = fi
			}
		}
	}
	return dirs
}

// checkDevicePluginDir refuses a device plugin whose endpoint is in one of dirs: by name, the
// directory of endpoint (kubelet's path) or of localEndpoint (this process's); by identity
// (look), the directory of localEndpoint, or of endpoint when there is none, as this process
// sees it. The endpoints are as written; a pattern's directory is the one that counts.
func (d *Driver) checkDevicePluginDir(p *field.Path, dirs []devicePluginDir, look func(string) (fs.FileInfo, error)) field.ErrorList {
	if d.Type != DevicePlugin {
		return nil
	}
	fields, values := []*field.Path{p.Child("endpoint")}, []string{d.Endpoint}
	if d.LocalEndpoint != "" {
		fields, values = append(fields, p.Child("localEndpoint")), append(values, d.LocalEndpoint)
	}
	for i, v := range values {
		if !filepath.IsAbs(v) {
			continue
		}
		in := filepath.Dir(filepath.Clean(v))
		for _, dp := range dirs {
			if in == dp.path {
				return field.ErrorList{field.Invalid(fields[i], v, devicePluginDirProblem(in, dp, false))}
			}
		}
	}
	// The path this process sees, through whatever links and mounts lead to it.
	fp, v := fields[len(fields)-1], values[len(values)-1]
	if look == nil || !filepath.IsAbs(v) {
		return nil
	}
	in := filepath.Dir(filepath.Clean(v))
	fi, err := look(in)
	if err != nil || !fi.IsDir() {
		return nil // not there (yet): compared by name only
	}
	for _, dp := range dirs {
		if dp.fi != nil && os.SameFile(fi, dp.fi) {
			return field.ErrorList{field.Invalid(fp, v, devicePluginDirProblem(in, dp, true))}
		}
	}
	return nil
}

// devicePluginDirProblem says why an endpoint in the directory in is refused: in is dp, by
// name or, when same, as the same directory through a link or a mount.
func devicePluginDirProblem(in string, dp devicePluginDir, same bool) string {
	where := "kubelet's device-plugin directory " + dp.path
	if dp.derived {
		where = fmt.Sprintf("%s, kubelet's device-plugin directory on a node that links it with %s (which kubelet uses whatever its root)",
			dp.path, KubeletDevicePluginDir)
	}
	if same {
		where = fmt.Sprintf("%s, the same directory here as %s", in, where)
	}
	move := "to a directory of its own"
	if dp.root != "" {
		move += " under " + filepath.Join(dp.root, "plugins")
	}
	return fmt.Sprintf("is in %s, where device plugins register themselves through kubelet.sock and kubelet removes every socket "+
		"when it starts: a second registration of a connected plugin makes kubelet 1.37 refuse its endpoint until kubelet restarts. "+
		"Remove the driver if the plugin registers itself, or move its socket %s (docs/drivers.md)", where, move)
}
