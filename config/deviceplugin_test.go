package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"multireg.dev/multireg/internal/testkit"
)

// TestKubeletDevicePluginDir: the directory refused is kubelet's own, as k8s.io/kubelet names
// it: a constant, whatever kubelet's root directory.
func TestKubeletDevicePluginDir(t *testing.T) {
	if want := filepath.Clean(pluginapi.DevicePluginPath); KubeletDevicePluginDir != want {
		t.Fatalf("KubeletDevicePluginDir %q, kubelet's is %q", KubeletDevicePluginDir, want)
	}
}

// TestDevicePluginDirByName: which directories are refused by name, by what registrationDir
// says of kubelet's root: kubelet's own always; the one under the root only when
// registrationDir names one (<root>/plugins_registry); never a plugin's directory of its own,
// the directory's parent, or a name that only starts alike.
func TestDevicePluginDirByName(t *testing.T) {
	for _, tt := range []struct {
		name, dir, endpoint string
		refused             bool
	}{
		{"no root named: kubelet's own", "/run/reg", "/var/lib/kubelet/device-plugins/x.sock", true},
		{"no root named: beside registrationDir", "/run/reg", "/run/device-plugins/x.sock", false},
		{"a root named: the one under it", "/run/k/plugins_registry/", "/run/k/device-plugins/x.sock", true},
		{"a root named: kubelet's own", "/run/k/plugins_registry", "/var/lib/kubelet/device-plugins/x.sock", true},
		{"own directory under another root", "/var/lib/k0s/kubelet/plugins_registry", "/var/lib/k0s/kubelet/plugins/x/dp.*", false},
		{"the directory's parent", "", "/var/lib/kubelet/x.sock", false},
		{"a name that only starts alike", "", "/var/lib/kubelet/device-plugins-x/x.sock", false},
		{"written otherwise", "", "/var/lib//kubelet/./device-plugins/x.sock", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := "apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\n"
			if tt.dir != "" {
				b += "registrationDir: " + tt.dir + "\n"
			}
			b += "drivers:\n- {name: example.com/x, type: DevicePlugin, endpoint: " + tt.endpoint + "}\n"
			_, err := ParseLocal([]byte(b))
			if refused := err != nil && strings.Contains(err.Error(), "where device plugins register themselves"); refused != tt.refused || (err != nil && !refused) {
				t.Errorf("refused %v, want %v: %v", refused, tt.refused, err)
			}
		})
	}
}

// TestDevicePluginDirThroughLinks: a device plugin's endpoint whose directory is the
// device-plugins directory under registrationDir's root through a symlink, either way, is
// refused by ParseLocal (what run and validate use), and by Parse only by name. Through
// localEndpoint, the path multireg sees, the refusal is on localEndpoint. A directory that is
// not there yet is compared by name only.
func TestDevicePluginDirThroughLinks(t *testing.T) {
	top := testkit.ShortDir(t)
	root := filepath.Join(top, "root")
	reg, dp := filepath.Join(root, "plugins_registry"), filepath.Join(root, "device-plugins")
	real := filepath.Join(top, "real")
	for _, d := range []string{reg, real} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// <root>/device-plugins is a link to another directory, and another link leads to it.
	if err := os.Symlink(real, dp); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(top, "link")
	if err := os.Symlink(dp, link); err != nil {
		t.Fatal(err)
	}
	file := func(fields string) []byte {
		return []byte("apiVersion: multireg.dev/v1alpha1\nkind: RegistrarConfig\nregistrationDir: " + reg +
			"\ndrivers:\n- {name: example.com/x, type: DevicePlugin, " + fields + "}\n")
	}
	plugins := filepath.Join(root, "plugins")
	for _, tt := range []struct {
		name, fields, want string
	}{
		{"the link's target", "endpoint: " + real + "/x.sock",
			inDevicePluginDir(`drivers[0].endpoint: "`+real+`/x.sock"`, real+", the same directory here as "+underRoot(dp), plugins)},
		{"a link to the directory", "endpoint: " + link + "/dp.*",
			inDevicePluginDir(`drivers[0].endpoint: "`+link+`/dp.*"`, link+", the same directory here as "+underRoot(dp), plugins)},
		{"localEndpoint", "endpoint: /var/lib/kubelet/plugins/x/x.sock, localEndpoint: " + link + "/x.sock",
			inDevicePluginDir(`drivers[0].localEndpoint: "`+link+`/x.sock"`, link+", the same directory here as "+underRoot(dp), plugins)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Parse(file(tt.fields)); err != nil {
				t.Errorf("Parse, which reads no file, refused: %v", err)
			}
			_, err := ParseLocal(file(tt.fields))
			if err == nil || err.Error() != tt.want {
				t.Errorf("ParseLocal:\n got: %v\nwant: %s", err, tt.want)
			}
		})
	}

	// Not there yet: nothing to compare but names.
	if _, err := ParseLocal(file("endpoint: " + filepath.Join(top, "later", "x.sock"))); err != nil {
		t.Errorf("an endpoint whose directory is not there yet: %v", err)
	}
	// A directory of its own passes.
	other := filepath.Join(top, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := ParseLocal(file("endpoint: " + other + "/x.sock")); err != nil {
		t.Errorf("an endpoint in a directory of its own: %v", err)
	}
}
