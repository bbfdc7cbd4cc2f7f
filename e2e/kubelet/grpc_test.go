package kubelet_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/grpc"

	"multireg.dev/multireg/e2e/kubelet"
)

// TestGRPCIsKubeletsOwn: the plugin manager of these suites talks to multireg with the gRPC
// release the real kubelet of that version was built with (the one its k8s.io/kubernetes
// go.mod requires): the frames, window updates and keepalives multireg's registration server
// sees are that release's, so a suite linked with another one would test another kubelet.
func TestGRPCIsKubeletsOwn(t *testing.T) {
	linked := moduleVersion(t, reflect.ValueOf(grpc.NewServer).Pointer(), "google.golang.org/grpc@")
	out, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		t.Fatalf("go env GOMODCACHE: %v", err)
	}
	mod := filepath.Join(strings.TrimSpace(string(out)), "cache", "download", "k8s.io", "kubernetes", "@v", kubelet.Version()+".mod")
	data, err := os.ReadFile(mod)
	if err != nil {
		t.Fatalf("kubelet's go.mod: %v", err)
	}
	var want string
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "google.golang.org/grpc" {
			want = f[1]
		}
	}
	if want == "" {
		t.Fatalf("%s requires no google.golang.org/grpc", mod)
	}
	if linked != want {
		t.Errorf("kubelet %s is built with gRPC %s; this suite links %s: pin it in the version's go.mod", kubelet.Version(), want, linked)
	}
}

// moduleVersion reads the version of the module holding the function at pc from its source
// path ("<module>@<version>/..."), as package kubelet reads its own.
func moduleVersion(t *testing.T, pc uintptr, marker string) string {
	t.Helper()
	fn := runtime.FuncForPC(pc)
	if fn == nil {
		t.Fatalf("no function at %#x", pc)
	}
	file, _ := fn.FileLine(pc)
	i := strings.LastIndex(file, marker)
	if i < 0 {
		t.Fatalf("source path %s has no %q", file, marker)
	}
	v, _, _ := strings.Cut(file[i+len(marker):], "/")
	return v
}
