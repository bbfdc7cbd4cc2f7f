package node_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"multireg.dev/multireg/e2e/node/cluster"
	"multireg.dev/multireg/e2e/node/endpoints"
)

// draClaimPod proves that the DRA registration multireg made is the one kubelet uses: a pod
// with a ResourceClaim for a device of the DRA driver (its ResourceSlice published here, as
// the driver's controller would) is scheduled, kubelet's DRA manager calls
// NodePrepareResources on the endpoint multireg registered, the pod runs; deleting it makes
// kubelet call NodeUnprepareResources.
func draClaimPod(t *testing.T, dra *endpoints.DRA) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rc := cl.Client.ResourceV1()
	node := cluster.NodeName
	never := int64(0)
	noToken := false
	claimName := "e2e-widget"
	objects := []struct {
		what   string
		create func() error
		del    func() error
	}{
		{"DeviceClass", func() error {
			_, err := rc.DeviceClasses().Create(ctx, &resourcev1.DeviceClass{
				ObjectMeta: metav1.ObjectMeta{Name: "e2e-widgets"},
				Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{
					CEL: &resourcev1.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", draName)},
				}}},
			}, metav1.CreateOptions{})
			return err
		}, func() error {
			return rc.DeviceClasses().Delete(context.Background(), "e2e-widgets", metav1.DeleteOptions{})
		}},
		{"ResourceSlice", func() error {
			_, err := rc.ResourceSlices().Create(ctx, &resourcev1.ResourceSlice{
				ObjectMeta: metav1.ObjectMeta{Name: "e2e-" + node},
				Spec: resourcev1.ResourceSliceSpec{
					Driver:   draName,
					Pool:     resourcev1.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1},
					NodeName: &node,
					Devices:  []resourcev1.Device{{Name: "dev-0"}},
				},
			}, metav1.CreateOptions{})
			return err
		}, func() error {
			return rc.ResourceSlices().Delete(context.Background(), "e2e-"+node, metav1.DeleteOptions{})
		}},
		{"ResourceClaim", func() error {
			_, err := rc.ResourceClaims("default").Create(ctx, &resourcev1.ResourceClaim{
				ObjectMeta: metav1.ObjectMeta{Name: claimName},
				Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{
					Name: "widget", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: "e2e-widgets"},
				}}}},
			}, metav1.CreateOptions{})
			return err
		}, func() error {
			return rc.ResourceClaims("default").Delete(context.Background(), claimName, metav1.DeleteOptions{})
		}},
		{"Pod", func() error {
			_, err := cl.Client.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "e2e-dra"},
				Spec: corev1.PodSpec{
					ResourceClaims:                []corev1.PodResourceClaim{{Name: "w", ResourceClaimName: &claimName}},
					AutomountServiceAccountToken:  &noToken,
					TerminationGracePeriodSeconds: &never,
					Containers: []corev1.Container{{
						Name: "c", Image: pauseRef, ImagePullPolicy: corev1.PullIfNotPresent,
						Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "w"}}},
					}},
				},
			}, metav1.CreateOptions{})
			return err
		}, func() error {
			return cl.Client.CoreV1().Pods("default").Delete(context.Background(), "e2e-dra", metav1.DeleteOptions{})
		}},
	}
	for _, o := range objects {
		if err := o.create(); err != nil {
			t.Fatalf("create %s: %v", o.what, err)
		}
		t.Cleanup(func() {
			if err := o.del(); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s: %v", o.what, err)
			}
		})
	}
	start := time.Now()
	waitUntil(t, 2*time.Minute, "the pod with a ResourceClaim runs", func(ctx context.Context) (bool, string) {
		p, err := cl.Client.CoreV1().Pods("default").Get(ctx, "e2e-dra", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return p.Status.Phase == corev1.PodRunning, podState(*p) + " " + fmt.Sprint(p.Status.Conditions)
	})
	if n := dra.Calls("NodePrepareResources"); n < 1 {
		t.Errorf("the pod runs, but kubelet never called NodePrepareResources on the DRA endpoint")
	} else {
		t.Logf("a pod claiming a %s device ran %.1fs after it was created; kubelet called NodePrepareResources %d time(s) on the endpoint multireg registered",
			draName, time.Since(start).Seconds(), n)
	}
	if err := cl.Client.CoreV1().Pods("default").Delete(ctx, "e2e-dra", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 2*time.Minute, "kubelet unprepares the claim once the pod is gone", func(ctx context.Context) (bool, string) {
		_, err := cl.Client.CoreV1().Pods("default").Get(ctx, "e2e-dra", metav1.GetOptions{})
		gone := apierrors.IsNotFound(err)
		n := dra.Calls("NodeUnprepareResources")
		return gone && n >= 1, fmt.Sprintf("pod gone: %v (%v); NodeUnprepareResources calls: %d", gone, err, n)
	})
}
