package images

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

// Registry is an OCI distribution registry served by this process (go-containerregistry's
// pkg/registry, blobs in memory) over plain HTTP on an ephemeral port of 127.0.0.1: the test
// cluster's containerd pulls every image from it, as a cluster pulls from its registry. It
// records the requests it answered, so that a test can tell what a pull fetched.
type Registry struct {
	// Host is the registry's "127.0.0.1:PORT", the first element of its images' references.
	Host string

	srv    *http.Server
	served chan error // Serve's result, once it returned
	stop   func() error

	mu       sync.Mutex
	requests []Request
}

// Request is one request the registry answered.
type Request struct {
	Method string
	Path   string // /v2/NAME/manifests/REFERENCE, /v2/NAME/blobs/DIGEST, …
	Status int
}

func (r Request) String() string { return fmt.Sprintf("%s %s %d", r.Method, r.Path, r.Status) }

// StartRegistry starts a Registry; its log of requests goes to logTo (nil: discarded). Close
// stops it.
func StartRegistry(logTo io.Writer) (*Registry, error) {
	if logTo == nil {
		logTo = io.Discard
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("registry: listen on 127.0.0.1: %w", err)
	}
	r := &Registry{Host: ln.Addr().String(), served: make(chan error, 1)}
	handler := registry.New(registry.Logger(log.New(logTo, "registry: ", log.LstdFlags|log.Lmicroseconds)))
	r.srv = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
			handler.ServeHTTP(sw, req)
			r.mu.Lock()
			r.requests = append(r.requests, Request{Method: req.Method, Path: req.URL.Path, Status: sw.status})
			r.mu.Unlock()
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	r.stop = sync.OnceValue(r.shutdown)
	go func() { r.served <- r.srv.Serve(ln) }()
	return r, nil
}

// Requests returns the requests answered so far, in order.
func (r *Registry) Requests() []Request {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.requests)
}

// Close stops the registry: it waits up to 10 s for requests in progress, then closes their
// connections, and returns once the server has stopped. Later calls return the first's result.
func (r *Registry) Close() error { return r.stop() }

func (r *Registry) shutdown() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := r.srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, r.srv.Close())
	}
	if serr := <-r.served; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	if err != nil {
		return fmt.Errorf("registry %s: stop: %w", r.Host, err)
	}
	return nil
}

// statusWriter remembers the status a handler wrote.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}
