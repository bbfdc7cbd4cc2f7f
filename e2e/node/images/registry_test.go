package images

import (
	"net/http"
	"slices"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// startRegistry starts a Registry that the test's cleanup closes.
func startRegistry(t *testing.T) *Registry {
	t.Helper()
	r, err := StartRegistry(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	return r
}

// The registry serves the distribution API over plain HTTP on the loopback, records what it
// answered, and stops.
func TestRegistry(t *testing.T) {
	r, err := StartRegistry(nil)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(r.Host+"/empty:v1", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, empty.Image, remote.WithContext(t.Context())); err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Get(tag, remote.WithContext(t.Context())); err != nil {
		t.Fatal(err)
	}
	missing := tag.Context().Tag("v2")
	if _, err := remote.Get(missing, remote.WithContext(t.Context())); err == nil {
		t.Errorf("get %s: no error; want not found", missing)
	}
	reqs := r.Requests()
	for _, want := range []Request{
		{http.MethodPut, "/v2/empty/manifests/v1", http.StatusCreated},
		{http.MethodGet, "/v2/empty/manifests/v1", http.StatusOK},
		{http.MethodGet, "/v2/empty/manifests/v2", http.StatusNotFound},
	} {
		if !slices.Contains(reqs, want) {
			t.Errorf("requests %v; want %v among them", reqs, want)
		}
	}

	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Errorf("a second Close: %v; want the first's result, nil", err)
	}
	if _, err := http.Get("http://" + r.Host + "/v2/"); err == nil {
		t.Errorf("GET http://%s/v2/ after Close: no error", r.Host)
	}
}
