package cluster

import (
	"slices"
	"strings"
	"testing"
)

func TestParseVersion(t *testing.T) {
	for in, want := range map[string]Version{
		"Kubernetes v1.37.2\n":         {1, 37, 2},
		"Kubernetes v1.35.4":           {1, 35, 4},
		"Kubernetes v1.36.0-rc.1\n":    {1, 36, 0},
		"  Kubernetes v2.0.11  \n\n\n": {2, 0, 11},
	} {
		got, err := ParseVersion(in)
		if err != nil || got != want {
			t.Errorf("ParseVersion(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "v1.37.2", "Kubernetes v0.0.0-master+$Format:%H$ trailing", "Kubernetes 1.37.2", "kubelet v1.37.2"} {
		if v, err := ParseVersion(in); err == nil {
			t.Errorf("ParseVersion(%q) = %v, want an error", in, v)
		}
	}
}

func TestFlagsFor(t *testing.T) {
	cloudStubs := []string{"-cloud-node-lifecycle", "-service-lb-controller", "-node-route-controller"}
	for _, tc := range []struct {
		v           Version
		newest      bool // 1.37 and later
		description string
	}{
		{Version{1, 35, 4}, false, "1.35"},
		{Version{1, 36, 3}, false, "1.36"},
		{Version{1, 37, 2}, true, "1.37"},
		{Version{1, 38, 0}, true, "1.38"},
		{Version{2, 0, 0}, true, "2.0"},
	} {
		f := flagsFor(tc.v)
		controllers := strings.Split(f.controllers, ",")
		for _, c := range []string{"*", "-nodeipam", "-persistentvolume-binder", "-attachdetach"} {
			if !slices.Contains(controllers, c) {
				t.Errorf("%s: --controllers=%s lacks %s", tc.description, f.controllers, c)
			}
		}
		for _, c := range cloudStubs {
			if named := slices.Contains(controllers, c); named == tc.newest {
				t.Errorf("%s: --controllers=%s: %s named: %v, want %v (1.37 removed the stub)", tc.description, f.controllers, c, named, !tc.newest)
			}
		}
		args := f.apiServerArgs("--a", "--b")
		if !slices.Equal(args[:2], []string{"--a", "--b"}) {
			t.Errorf("%s: kube-apiserver's common arguments lost: %v", tc.description, args)
		}
		if slices.Contains(args, "--endpoint-reconciler-type=none") != tc.newest {
			t.Errorf("%s: kube-apiserver's arguments %v: --endpoint-reconciler-type=none wanted: %v", tc.description, args, tc.newest)
		}
	}
}
