package probe

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

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

// TestHealthServicesDetected: the driver's answer tells the services a DRA endpoint serves
// from those it does not, whether it comes at once or a second later (within the probe's
// bound): an Unimplemented is not served however late it comes; a message is served; a stream
// that stays open without a word is served by silence, and says so.
func TestHealthServicesDetected(t *testing.T) {
	v1, v1alpha1 := drahealthv1.DRAResourceHealthService, drahealthv1alpha1.DRAResourceHealthService
	for _, tt := range []struct {
		serves []string
		delay  time.Duration
		want   Health
	}{
		{nil, 0, Health{{Service: v1}, {Service: v1alpha1}}},
		{nil, time.Second, Health{{Service: v1}, {Service: v1alpha1}}},
		{[]string{"v1alpha1"}, 0, Health{{Service: v1}, {Service: v1alpha1, Served: true}}},
		{[]string{"v1alpha1"}, time.Second, Health{{Service: v1}, {Service: v1alpha1, Served: true}}},
		{[]string{"v1"}, 0, Health{{Service: v1, Served: true}, {Service: v1alpha1}}},
		{[]string{"v1"}, time.Second, Health{{Service: v1, Served: true}, {Service: v1alpha1}}},
		{[]string{"v1-quiet"}, 0, Health{{Service: v1, Served: true, Silent: true}, {Service: v1alpha1}}},
		{[]string{"v1", "v1alpha1"}, 0, Health{{Service: v1, Served: true}, {Service: v1alpha1, Served: true}}},
	} {
		name := strings.Join(append([]string{"serves"}, tt.serves...), "-")
		if tt.delay > 0 {
			name += "-after-" + tt.delay.String()
		}
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(testkit.ShortDir(t), "dra.sock")
			testkit.HealthEndpointWith(t, path, testkit.HealthOptions{Services: tt.serves, Delay: tt.delay})
			got, err := HealthServices(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("HealthServices = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestHealthServicesAskedTogether: both versions are asked at once, within one bound: an
// endpoint that answers either only once both calls have come gets an answer for each, rather
// than the first call's silence.
func TestHealthServicesAskedTogether(t *testing.T) {
	path := filepath.Join(testkit.ShortDir(t), "dra.sock")
	var arrived sync.WaitGroup
	arrived.Add(len(config.HealthServices))
	all := make(chan struct{})
	go func() { arrived.Wait(); close(all) }()
	testkit.HealthEndpointWith(t, path, testkit.HealthOptions{Services: []string{"v1", "v1alpha1"}, Hold: func(ctx context.Context) {
		arrived.Done()
		select {
		case <-all:
		case <-ctx.Done():
		}
	}})
	got, err := HealthServices(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	want := Health{{Service: drahealthv1.DRAResourceHealthService, Served: true}, {Service: drahealthv1alpha1.DRAResourceHealthService, Served: true}}
	if !slices.Equal(got, want) {
		t.Errorf("HealthServices = %+v, want %+v: each answered, none silent", got, want)
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
		t.Fatalf("HealthServices on an endpoint that speaks no gRPC = %+v, want an error", got)
	}
}
