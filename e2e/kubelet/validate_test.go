package kubelet

import (
	"strings"
	"testing"
)

func TestValidateCSIVersions(t *testing.T) {
	for _, tt := range []struct {
		give    []string
		want    string
		wantErr string
	}{
		{give: []string{"1.0.0"}, want: "1.0.0"},
		{give: []string{"v1.0.0"}, want: "1.0.0"},
		{give: []string{"1.2"}, want: "1.2"},
		{give: []string{"0.3.0", "1.1.0"}, want: "1.1.0"},
		{give: []string{"2.0.0", "1.0.0"}, want: "1.0.0"},
		{give: []string{"0.3.0"}, wantErr: "must be v1.x"},
		{give: nil, wantErr: "empty"},
		{give: []string{"1"}, wantErr: "none of the versions"},
		{give: []string{"2.0.0"}, wantErr: "none of the versions"},
		{give: []string{"v1"}, wantErr: "none of the versions"},
	} {
		got, err := validateCSIVersions(tt.give)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("validateCSIVersions(%q) = %v, %v; want error with %q", tt.give, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got.String() != tt.want {
			t.Errorf("validateCSIVersions(%q) = %v, %v; want %s", tt.give, got, err, tt.want)
		}
	}
}

func TestValidateDRAServices(t *testing.T) {
	// want133 is what 1.33 chooses (see DRAFallsBackToAlpha): the most recent service it knows,
	// else v1alpha4's, whatever the plugin lists; it never refuses a non-empty list.
	const alpha = "v1alpha3.NodeService"
	for _, tt := range []struct {
		give          []string
		want, want133 string
		wantErr       bool
	}{
		{give: []string{"v1.DRAPlugin", "v1beta1.DRAPlugin"}, want: "v1.DRAPlugin", want133: "v1beta1.DRAPlugin"},
		{give: []string{"v1beta1.DRAPlugin", "v1.DRAPlugin"}, want: "v1beta1.DRAPlugin", want133: "v1beta1.DRAPlugin"},
		{give: []string{"v1alpha1.DRAResourceHealth", "v1.DRAPlugin"}, want: "v1.DRAPlugin", want133: alpha},
		{give: []string{"v1alpha4"}, wantErr: true, want133: alpha},
		{give: []string{"1.0.0"}, wantErr: true, want133: alpha},
		{give: nil, wantErr: true},
	} {
		if DRAFallsBackToAlpha() && tt.give != nil {
			tt.want, tt.wantErr = tt.want133, false
		}
		got, err := validateDRAServices(tt.give)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("validateDRAServices(%q) = %q, %v; want %q, error %v", tt.give, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestValidateDevicePlugin(t *testing.T) {
	for _, tt := range []struct {
		name     string
		versions []string
		wantErr  bool
	}{
		{name: "example.com/gpu", versions: []string{"v1beta1"}},
		{name: "devices.monogon.dev/kvm", versions: []string{"v1alpha", "v1beta1"}},
		{name: "example.com/gpu", versions: []string{"v1alpha"}, wantErr: true},
		{name: "example.com/gpu", versions: nil, wantErr: true},
		{name: "gpu", versions: []string{"v1beta1"}, wantErr: true},
		{name: "kubernetes.io/gpu", versions: []string{"v1beta1"}, wantErr: true},
		{name: "nvidia.kubernetes.io/gpu", versions: []string{"v1beta1"}, wantErr: true},
		{name: "requests.example.com/gpu", versions: []string{"v1beta1"}, wantErr: true},
		{name: "example.com/gpu/x", versions: []string{"v1beta1"}, wantErr: true},
		{name: "example.com/-gpu", versions: []string{"v1beta1"}, wantErr: true},
		{name: "Example.com/gpu", versions: []string{"v1beta1"}, wantErr: true},
	} {
		err := validateDevicePlugin(tt.name, tt.versions)
		if (err != nil) != tt.wantErr {
			t.Errorf("validateDevicePlugin(%q, %q) = %v; want error %v", tt.name, tt.versions, err, tt.wantErr)
		}
	}
}
