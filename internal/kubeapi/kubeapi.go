// Package kubeapi is multireg's one door to the Kubernetes API: a client (Connect) and a
// watch of one named object (Watch). Only the node condition's agent links it
// (cmd/multireg-nodecond, package nodecond/agent): multireg itself never does, so that a
// multireg without the condition carries none of client-go (linked, its packages'
// initialisation alone cost 4.4 MiB of resident memory at 1000 drivers, the feature off).
//
// It uses client-go's dynamic client, and decodes the few fields it reads into types of its
// own: the typed clientset (every API group's scheme, registered at start by package init)
// makes a process 10 MiB larger than the dynamic client does, measured. client-go's informers
// (tools/cache) link the typed clientset too; Watch is the list-then-watch loop they would
// run, for one object by name.
package kubeapi

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"multireg.dev/multireg/internal/pause"
)

// The resources multireg reads and writes: its node, and the node's CSINode (kubelet's record
// of the CSI drivers it registered).
var (
	Nodes    = schema.GroupVersionResource{Version: "v1", Resource: "nodes"}
	CSINodes = schema.GroupVersionResource{Group: "storage.k8s.io", Version: "v1", Resource: "csinodes"}
)

// RequestTimeout bounds every request but a watch's: a slow API server delays only the
// condition, which the next attempt catches up.
const RequestTimeout = 10 * time.Second

// Connect returns a client of the API server that kubeconfig names, or, when kubeconfig is
// empty, of the cluster the process runs in (its pod's service account). userAgent says who
// asks.
func Connect(kubeconfig, userAgent string) (dynamic.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
	} else {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("no Kubernetes API configuration: not in a pod (%w); give --kubeconfig", err)
		}
	}
	cfg.UserAgent = userAgent
	// A node agent: a few requests a minute at most (package nodecond bounds its writes), and
	// never a burst that would matter to the API server.
	cfg.QPS, cfg.Burst = 5, 10
	return dynamic.NewForConfig(cfg)
}

// Backoff between failed attempts to read or write: doubling from backoffMin to backoffMax,
// each wait jittered by ±20% so that a fleet's nodes do not come back in step. backoffMax
// bounds how long the condition lags an API server that is back: at 5,000 nodes, a list or a
// write from each within 10 s.
const (
	backoffMin = time.Second
	backoffMax = 8 * time.Second
)

// NewBackoff returns a wait that doubles from backoffMin to backoffMax, each jittered by ±20%,
// and never gives up; Reset starts it over.
func NewBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.Multiplier, b.MaxInterval = backoffMin, 2, backoffMax
	b.RandomizationFactor, b.MaxElapsedTime = 0.2, 0
	b.Reset()
	return b
}

// Jitter is d ±20%.
func Jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// Event is what a watch of one object saw: the object (nil: it does not exist), or why the
// watch cannot see it now (Err: the API server does not answer, or refuses).
type Event struct {
	Object *unstructured.Unstructured
	Err    error
}

// Watch reports the named object of resource gvr to seen: its state when the watch begins,
// each change, and its absence; and, while the API server cannot be read, the error, once
// per failed attempt. It lists the object by name and watches from there, again after a
// watch ends, and lists again after an error (with Backoff) or when the API server no longer
// has the watched version. It returns when ctx ends. seen runs on Watch's goroutine.
func Watch(ctx context.Context, c dynamic.Interface, gvr schema.GroupVersionResource, name string, seen func(Event)) {
	res := c.Resource(gvr)
	sel := fields.OneTermEqualSelector("metadata.name", name).String()
	b := NewBackoff()
	for ctx.Err() == nil {
		rv, err := list(ctx, res, sel, seen)
		for err == nil && ctx.Err() == nil {
			rv, err = watchFrom(ctx, res, sel, rv, seen)
		}
		if ctx.Err() != nil {
			return
		}
		if !errors.Is(err, errExpired) {
			seen(Event{Err: err})
			pause.For(ctx, b.NextBackOff())
			continue
		}
		b.Reset() // the watched version is gone: list again at once
	}
}

// errExpired: the API server no longer has the version a watch asked for.
var errExpired = errors.New("the watched resource version is gone")

// list reads the object and reports it, and returns the list's resource version.
func list(ctx context.Context, res dynamic.NamespaceableResourceInterface, sel string, seen func(Event)) (string, error) {
	lctx, cancel := context.WithTimeout(ctx, RequestTimeout)
	defer cancel()
	l, err := res.List(lctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		return "", err
	}
	var obj *unstructured.Unstructured
	if len(l.Items) > 0 {
		obj = &l.Items[0]
	}
	seen(Event{Object: obj})
	return l.GetResourceVersion(), nil
}

// watchFrom watches from resource version rv until the watch ends (the server's timeout, a
// broken connection: nil, watch again) or fails, and returns the last version seen.
func watchFrom(ctx context.Context, res dynamic.NamespaceableResourceInterface, sel, rv string, seen func(Event)) (string, error) {
	timeout := int64(Jitter(5 * time.Minute).Seconds())
	w, err := res.Watch(ctx, metav1.ListOptions{FieldSelector: sel, ResourceVersion: rv, AllowWatchBookmarks: true, TimeoutSeconds: &timeout})
	if err != nil {
		if apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			return rv, errExpired
		}
		return rv, err
	}
	defer w.Stop()
	for {
		select {
		case <-ctx.Done():
			return rv, nil
		case ev, ok := <-w.ResultChan():
			if !ok {
				return rv, nil
			}
			switch ev.Type {
			case watch.Error:
				if st := apierrors.FromObject(ev.Object); apierrors.IsResourceExpired(st) || apierrors.IsGone(st) {
					return rv, errExpired
				} else {
					return rv, st
				}
			case watch.Bookmark:
			case watch.Added, watch.Modified, watch.Deleted:
			default:
				continue
			}
			obj, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			rv = obj.GetResourceVersion()
			switch ev.Type {
			case watch.Added, watch.Modified:
				seen(Event{Object: obj})
			case watch.Deleted:
				seen(Event{})
			}
		}
	}
}
