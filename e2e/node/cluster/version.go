package cluster

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Version is the Kubernetes release of the cluster's binaries.
type Version struct{ Major, Minor, Patch int }

func (v Version) String() string { return fmt.Sprintf("v%d.%d.%d", v.Major, v.Minor, v.Patch) }

// AtLeast reports whether v is the release major.minor or a later one.
func (v Version) AtLeast(major, minor int) bool {
	return v.Major > major || v.Major == major && v.Minor >= minor
}

var versionLine = regexp.MustCompile(`^Kubernetes v(\d+)\.(\d+)\.(\d+)\S*$`)

// ParseVersion reads what a Kubernetes command's --version prints ("Kubernetes v1.37.2").
func ParseVersion(s string) (Version, error) {
	m := versionLine.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return Version{}, fmt.Errorf("not a Kubernetes version: %q", strings.TrimSpace(s))
	}
	var v Version
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	v.Patch, _ = strconv.Atoi(m[3])
	return v, nil
}

// binariesVersion is the release the server binaries in dir report; they must all report
// the same one.
func binariesVersion(dir string) (Version, error) {
	var first Version
	for i, b := range []string{"kube-apiserver", "kubelet", "kube-controller-manager", "kube-scheduler"} {
		out, err := runFor(30*time.Second, filepath.Join(dir, b), "--version")
		if err != nil {
			return Version{}, fmt.Errorf("%s --version: %w", b, err)
		}
		v, err := ParseVersion(out)
		if err != nil {
			return Version{}, fmt.Errorf("%s --version: %w", b, err)
		}
		if i == 0 {
			first = v
		} else if v != first {
			return Version{}, fmt.Errorf("%s is %s, kube-apiserver %s: the binaries of %s are of different releases", b, v, first, dir)
		}
	}
	return first, nil
}

// releaseFlags are the components' flags that differ between the releases the test runs on
// (1.35 to 1.37), chosen from the binaries' version; every other flag is the same on all.
type releaseFlags struct {
	apiServer   []string // added to kube-apiserver's
	controllers string   // kube-controller-manager's --controllers
}

// apiServerArgs are kube-apiserver's arguments: common, the same on every release, and this
// release's own.
func (f releaseFlags) apiServerArgs(common ...string) []string { return append(common, f.apiServer...) }

func flagsFor(v Version) releaseFlags {
	var f releaseFlags
	// Not run on this single node: node IPAM (no pod CIDRs to hand out; the CNI bridge has its
	// own range), the PersistentVolume binder and attach/detach (no volumes but inline CSI ones).
	controllers := []string{"*", "-nodeipam", "-persistentvolume-binder", "-attachdetach"}
	if v.AtLeast(1, 37) {
		// 1.37 checks the advertised address with the endpoint reconciler (ValidateIP in
		// pkg/controlplane/instance.go) and the lease reconciler refuses a loopback one:
		// "cannot use public IP 127.0.0.1 with endpoint reconciler". Upstream's own test API
		// server sets none; the kubernetes Service then has no endpoints (nothing here uses it).
		f.apiServer = append(f.apiServer, "--endpoint-reconciler-type=none")
	} else {
		// Up to 1.36 the stub cloud controllers are known (and skipped without a cloud
		// provider); 1.37 removed them, and naming them in --controllers is an error.
		controllers = append(controllers, "-cloud-node-lifecycle", "-service-lb-controller", "-node-route-controller")
	}
	f.controllers = strings.Join(controllers, ",")
	return f
}
