package probe

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/testkit"
)

// TestHealthServiceNames: the names multireg advertises are kubelet's own, and each can be
// asked.
func TestHealthServiceNames(t *testing.T) {
	want := []string{drahealthv1.DRAResourceHealthService, drahealthv1alpha1.DRAResourceHealthService}
	if !slices.Equal(config.HealthServices, want) {
		t.Errorf("config.HealthServices = %q, want kubelet's %q, newest first", config.HealthServices, want)
	}
	for _, svc := range config.HealthServices {
		if healthWatches[svc] == nil {
			t.Errorf("no NodeWatchResources call for %s", svc)
		}
	}
}

// TestHealthServicesDetected: the services a DRA endpoint serves are told apart from those it
// does not, whether its stream sends at once or stays quiet.
func TestHealthServicesDetected(t *testing.T) {
	for _, tt := range []struct {
		serves []string
		want   []string
	}{
		{nil, nil},
		{[]string{"v1alpha1"}, []string{"v1alpha1.DRAResourceHealth"}},
		{[]string{"v1"}, []string{"v1.DRAResourceHealth"}},
		{[]string{"v1-quiet"}, []string{"v1.DRAResourceHealth"}},
		{[]string{"v1", "v1alpha1"}, []string{"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}},
	} {
		t.Run(strings.Join(append([]string{"serves"}, tt.serves...), "-"), func(t *testing.T) {
			path := filepath.Join(testkit.ShortDir(t), "dra.sock")
			testkit.HealthEndpoint(t, path, tt.serves...)
			got, err := HealthServices(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("healthServices = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestHealthServicesNoAnswer: an endpoint that accepts connections and never speaks gRPC is
// not ready, rather than taken to serve health.
func TestHealthServicesNoAnswer(t *testing.T) {
	path := filepath.Join(testkit.ShortDir(t), "dra.sock")
	l, err := testkit.ListenUnlinked(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	// The kernel completes the connections; nothing ever answers on them.
	got, err := HealthServices(context.Background(), path)
	if err == nil {
		t.Fatalf("healthServices on a silent endpoint = %q, want an error", got)
	}
}
