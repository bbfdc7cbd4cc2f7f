package manifests

import (
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// renderTestPod renders the chart's `helm test` pod.
func renderTestPod(t testing.TB, c *chart.Chart, values map[string]any) *corev1.Pod {
	t.Helper()
	files, err := renderFiles(c, values)
	if err != nil {
		t.Fatal(err)
	}
	var pod *corev1.Pod
	for name, f := range files {
		if strings.Contains(name, "/templates/tests/") && strings.TrimSpace(f) != "" {
			gvk := schema.GroupVersionKind{Version: "v1", Kind: "Pod"}
			obj, _, err := strictSerializer.Decode([]byte(f), &gvk, nil)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			pod = obj.(*corev1.Pod)
		}
	}
	if pod == nil {
		t.Fatal("no test pod")
	}
	return pod
}

// TestChartHelmTest: the chart's `helm test` pod validates the drivers file of the release's
// ConfigMap at the path the DaemonSet reads it, with a command line multireg accepts, as a
// pod the DaemonSet never adopts (none of its selector's labels), without API access or
// privilege. On every render of chartCases.
func TestChartHelmTest(t *testing.T) {
	c := loadChart(t)
	for _, tc := range chartCases {
		t.Run(tc.name, func(t *testing.T) {
			values := readValues(t, tc.values)
			pod := renderTestPod(t, c, values)
			d, _ := renderChartDeployment(t, c, values)
			if pod.Annotations["helm.sh/hook"] != "test" {
				t.Errorf("annotations %v: want helm.sh/hook: test", pod.Annotations)
			}
			if sel := labels.SelectorFromSet(d.ds.Spec.Selector.MatchLabels); sel.Matches(labels.Set(pod.Labels)) {
				t.Errorf("labels %v: the DaemonSet's selector %v matches them, and would adopt the pod", pod.Labels, sel)
			}
			if pod.Spec.AutomountServiceAccountToken == nil || *pod.Spec.AutomountServiceAccountToken || pod.Spec.RestartPolicy != corev1.RestartPolicyNever {
				t.Errorf("automountServiceAccountToken %v, restartPolicy %s: want false, Never", pod.Spec.AutomountServiceAccountToken, pod.Spec.RestartPolicy)
			}
			ct := pod.Spec.Containers[0]
			if ct.Image != d.container.Image {
				t.Errorf("image %s, want the DaemonSet's %s", ct.Image, d.container.Image)
			}
			if want := []string{"validate", "--config=" + d.configPath}; strings.Join(ct.Args, " ") != strings.Join(want, " ") {
				t.Errorf("args %q, want %q", ct.Args, want)
			}
			if err := checkArgs(t, ct.Args); err != nil {
				t.Error(err)
			}
			var cm string
			for _, v := range pod.Spec.Volumes {
				if v.ConfigMap != nil {
					cm = v.ConfigMap.Name
				}
			}
			if cm != d.cm.Name || len(ct.VolumeMounts) != 1 || !strings.HasPrefix(d.configPath, ct.VolumeMounts[0].MountPath+"/") {
				t.Errorf("ConfigMap %q mounted at %v: want the DaemonSet's %q, at its --config's directory", cm, ct.VolumeMounts, d.cm.Name)
			}
			if sc := ct.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("securityContext %+v: want a read-only root and no privilege escalation", sc)
			}
		})
	}
}
