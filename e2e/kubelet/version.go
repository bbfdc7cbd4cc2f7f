package kubelet

import (
	"fmt"
	"reflect"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

const kubernetesModule = "k8s.io/kubernetes"

// linkedVersion is the version of the k8s.io/kubernetes module this binary is linked with: it
// is how one set of sources tells which go.mod (-modfile) it was built with.
//
// The go command records module versions in a binary's build information, but not in a test
// binary's (it has no Deps). Every module-mode build, test binaries and -trimpath included,
// keeps the source path of each function, and a module's files sit under "<path>@<version>/",
// so the position of a function of the module gives the version too.
var linkedVersion = sync.OnceValues(func() (*version.Version, error) {
	v, err := versionFromBuildInfo()
	if err != nil {
		v, err = versionFromSourcePath()
	}
	if err != nil {
		return nil, err
	}
	return version.ParseSemantic(v)
})

func versionFromBuildInfo() (string, error) {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "", fmt.Errorf("no build information in this binary")
	}
	for _, m := range bi.Deps {
		if m.Path != kubernetesModule {
			continue
		}
		if m.Replace != nil && m.Replace.Version != "" {
			m = m.Replace
		}
		return m.Version, nil
	}
	return "", fmt.Errorf("%s is not in this binary's build information", kubernetesModule)
}

func versionFromSourcePath() (string, error) {
	pc := reflect.ValueOf(pluginmanager.NewPluginManager).Pointer()
	fn := runtime.FuncForPC(pc)
	if fn == nil {
		return "", fmt.Errorf("no function at %#x", pc)
	}
	file, _ := fn.FileLine(pc)
	const marker = kubernetesModule + "@"
	i := strings.LastIndex(file, marker)
	if i < 0 {
		return "", fmt.Errorf("version of %s: source path %s has no %q", kubernetesModule, file, marker)
	}
	v, _, ok := strings.Cut(file[i+len(marker):], "/")
	if !ok {
		return "", fmt.Errorf("version of %s: source path %s", kubernetesModule, file)
	}
	return v, nil
}

// Version returns the version of the kubelet plugin manager linked into this binary, such as
// "v1.36.3", or "unknown".
func Version() string {
	v, err := linkedVersion()
	if err != nil {
		return "unknown"
	}
	return "v" + v.String()
}

// RetriesRegisterFailures reports whether the linked kubelet retries a failed RegisterPlugin
// step on the same socket (1.36 and later). An older kubelet leaves the plugin failed until its
// registration socket is recreated.
//
// The difference is in GenerateRegisterPluginFunc of
// pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go: from 1.36 a failed
// RegisterPlugin, or a failed NotifyRegistrationStatus after a successful one, removes the
// socket from the actual state of the world (and the latter calls DeRegisterPlugin), so the
// reconciler registers it again; up to 1.35 the plugin stays in the actual state.
func RetriesRegisterFailures() bool { return atLeast(36) }

// DRAFallsBackToAlpha reports whether the linked kubelet's DRA handler accepts a plugin
// whatever services it lists (1.33: validateSupportedServices of
// pkg/kubelet/cm/dra/plugin/registration.go falls back to v1alpha4's "v1alpha3.NodeService"
// and knows no "v1.DRAPlugin"). From 1.34 the plugin must list "v1.DRAPlugin" or
// "v1beta1.DRAPlugin", or ValidatePlugin refuses it.
func DRAFallsBackToAlpha() bool { return !atLeast(34) }

// DevicePluginsKeyedByEndpoint reports whether the linked kubelet's device manager keeps a
// client per (resource, endpoint) (1.37, pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go:
// RegisterPlugin adds one, DeRegisterPlugin removes the one of its endpoint). Up to 1.36 it keeps
// one client per resource: a registration replaces it, and DeRegisterPlugin of any endpoint of
// the name removes it.
func DevicePluginsKeyedByEndpoint() bool { return atLeast(37) }

// atLeast reports whether the linked kubelet is 1.minor or newer. It panics if the version is
// unknown, which a binary built by the go command in module mode never is.
func atLeast(minor uint) bool {
	v, err := linkedVersion()
	if err != nil {
		panic(fmt.Sprintf("kubelet version: %v", err))
	}
	return v.AtLeast(version.MajorMinor(1, minor))
}
