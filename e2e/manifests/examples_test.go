package manifests

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// The examples' fixed names: `kubectl -n kube-system exec ds/multireg` in the docs relies on them.
const (
	exampleName      = "multireg"
	exampleNamespace = "kube-system"
	kubeletRoot      = "/var/lib/kubelet"
)

// exampleFiles returns every YAML file under examples/, relative to it.
func exampleFiles(t *testing.T) (dir string, files []string) {
	t.Helper()
	dir = filepath.Join(repoRoot(t), "examples")
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		// The Prometheus Operator's kinds and a plain rules file: TestMonitoringExamples
		// decodes them.
		if e.IsDir() && p == filepath.Join(dir, "monitoring") {
			return fs.SkipDir
		}
		if ext := filepath.Ext(p); !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
			rel, err := filepath.Rel(dir, p)
			files = append(files, rel)
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir, files
}

// TestExampleFiles decodes every document of every YAML file under examples/ by its kind:
// Kubernetes objects strictly into their k8s.io/api types, kustomizations strictly into
// kustomize's type, drivers files through `multireg validate`.
func TestExampleFiles(t *testing.T) {
	dir, files := exampleFiles(t)
	for _, want := range []string{"config.yaml", "daemonset.yaml", "kustomization.yaml", filepath.Join("local", "config.yaml")} {
		if !slices.Contains(files, want) {
			t.Errorf("examples/%s is missing (found %q)", want, files)
		}
	}
	for _, file := range files {
		t.Run(file, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join(dir, file))
			if err != nil {
				t.Fatal(err)
			}
			docs, err := splitDocuments(b)
			if err != nil {
				t.Fatal(err)
			}
			if len(docs) == 0 {
				t.Fatal("no YAML document")
			}
			for i, doc := range docs {
				tm, err := typeOf(doc)
				if err != nil {
					t.Fatalf("document %d: %v", i+1, err)
				}
				switch tm {
				case kindKustomization:
					_, err = decodeKustomization(doc)
				case kindRegistrar:
					if len(docs) != 1 {
						t.Errorf("a drivers file holds one document, not %d", len(docs))
					}
					err = validate(t, "examples/"+file, doc)
				default:
					_, err = decodeObject(doc)
				}
				if err != nil {
					t.Errorf("document %d: %v", i+1, err)
				}
			}
		})
	}
}

// renderKustomization is `kubectl kustomize dir`: kustomize's own Go API, as kubectl embeds it.
func renderKustomization(dir string) ([]byte, error) {
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, err
	}
	return m.AsYaml()
}

// TestExamplesKustomize renders examples/ as `kubectl apply -k examples/` would and checks the
// result: strict decoding, the deployment contract, multireg's validation of the ConfigMap.
func TestExamplesKustomize(t *testing.T) {
	dir := filepath.Join(repoRoot(t), "examples")
	out, err := renderKustomization(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeManifests(out)
	if err != nil {
		t.Fatalf("kustomize output: %v\n%s", err, out)
	}
	d := checkDeployment(t, "kubectl apply -k examples/", m, expectations{root: kubeletRoot})

	// One name, never a hash suffix: an edit of config.yaml must update the ConfigMap in place
	// and leave the DaemonSet (and so every pod) alone.
	for _, meta := range []struct{ kind, name, namespace string }{
		{"DaemonSet", d.ds.Name, d.ds.Namespace},
		{"ConfigMap", d.cm.Name, d.cm.Namespace},
	} {
		if meta.name != exampleName || meta.namespace != exampleNamespace {
			t.Errorf("%s %s/%s; want %s/%s", meta.kind, meta.namespace, meta.name, exampleNamespace, exampleName)
		}
	}
	// The ConfigMap is examples/config.yaml, byte for byte: one source of truth.
	want, err := os.ReadFile(filepath.Join(dir, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(d.config, want) {
		t.Errorf("the ConfigMap's config.yaml differs from examples/config.yaml")
	}
}

// TestExamplesHashSuffixIsCaught shows that TestExamplesKustomize would notice kustomize's
// default hash suffix: without disableNameSuffixHash the ConfigMap gets another name.
func TestExamplesHashSuffixIsCaught(t *testing.T) {
	src := filepath.Join(repoRoot(t), "examples")
	dst := t.TempDir()
	for _, f := range []string{"config.yaml", "daemonset.yaml", "kustomization.yaml"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if f == "kustomization.yaml" {
			if !bytes.Contains(b, []byte("disableNameSuffixHash: true")) {
				t.Fatal("kustomization.yaml does not disable the name suffix hash")
			}
			b = bytes.ReplaceAll(b, []byte("disableNameSuffixHash: true"), []byte("disableNameSuffixHash: false"))
		}
		if err := os.WriteFile(filepath.Join(dst, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	out, err := renderKustomization(dst)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeManifests(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.configMaps) != 1 || m.configMaps[0].Name == exampleName || !strings.HasPrefix(m.configMaps[0].Name, exampleName+"-") {
		t.Fatalf("ConfigMaps %v: want one with a hash suffix", m.configMaps)
	}
}

// TestDeploymentChecksFail breaks the examples' DaemonSet in each way the checks must catch.
func TestDeploymentChecksFail(t *testing.T) {
	out, err := renderKustomization(filepath.Join(repoRoot(t), "examples"))
	if err != nil {
		t.Fatal(err)
	}
	good, err := decodeManifests(out)
	if err != nil {
		t.Fatal(err)
	}
	mount := func(c *corev1.Container, name string) *corev1.VolumeMount {
		for i := range c.VolumeMounts {
			if c.VolumeMounts[i].Name == name {
				return &c.VolumeMounts[i]
			}
		}
		t.Fatalf("no volume mount %q", name)
		return nil
	}
	setArg := func(c *corev1.Container, prefix, arg string) {
		for i, a := range c.Args {
			if strings.HasPrefix(a, prefix) {
				c.Args[i] = arg
				return
			}
		}
		t.Fatalf("no argument %s…", prefix)
	}
	// The documented alternative to the surge: old pod first.
	oldPodFirst := func(ds *appsv1.DaemonSet, _ *corev1.Container) {
		zero, one := intstr.FromInt32(0), intstr.FromInt32(1)
		ds.Spec.UpdateStrategy.RollingUpdate = &appsv1.RollingUpdateDaemonSet{MaxSurge: &zero, MaxUnavailable: &one}
	}
	// The health checks as the chart serves them (healthChecks.enabled): the host's network,
	// --health-endpoint, probes by number, and no port unless withPort.
	healthChecks := func(withPort bool) func(ds *appsv1.DaemonSet, c *corev1.Container) {
		return func(ds *appsv1.DaemonSet, c *corev1.Container) {
			ds.Spec.Template.Spec.HostNetwork = true
			ds.Spec.Template.Spec.DNSPolicy = corev1.DNSClusterFirstWithHostNet
			c.Args = append(c.Args, "--health-endpoint=:9810")
			c.LivenessProbe.HTTPGet.Port = intstr.FromInt32(9809)
			c.ReadinessProbe.HTTPGet.Port = intstr.FromInt32(9809)
			if !withPort {
				c.Ports = nil
			}
		}
	}
	tests := []struct {
		name   string
		break_ func(ds *appsv1.DaemonSet, c *corev1.Container)
		want   expectations
		wantP  string // in a problem; "" for none
	}{
		{"unchanged", func(*appsv1.DaemonSet, *corev1.Container) {}, expectations{root: kubeletRoot}, ""},
		{"config with subPath", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			m := mount(c, "config")
			m.SubPath, m.MountPath = "config.yaml", "/etc/multireg/config.yaml"
		}, expectations{}, "subPath"},
		{"config elsewhere", func(_ *appsv1.DaemonSet, c *corev1.Container) { mount(c, "config").MountPath = "/config" }, expectations{}, "not in a ConfigMap volume"},
		{"plugins at another path", func(_ *appsv1.DaemonSet, c *corev1.Container) { mount(c, "plugins-dir").MountPath = "/host/plugins" }, expectations{}, "endpoint /var/lib/kubelet/plugins/csi-nfsplugin/csi.sock: not under any host directory"},
		{"registry read-only", func(_ *appsv1.DaemonSet, c *corev1.Container) { mount(c, "registration-dir").ReadOnly = true }, expectations{}, "read-only"},
		{"another kubelet root", func(*appsv1.DaemonSet, *corev1.Container) {}, expectations{root: "/var/lib/rancher/k3s/agent/kubelet"}, "not under the kubelet root"},
		{"old pod first, not asked for", oldPodFirst, expectations{}, "maxSurge 0 maxUnavailable 1; want RollingUpdate maxSurge 1 maxUnavailable 0"},
		{"old pod first, as documented", oldPodFirst, expectations{noSurge: true}, ""},
		{"surge and unavailable", func(ds *appsv1.DaemonSet, _ *corev1.Container) {
			one := intstr.FromInt32(1)
			ds.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable = &one
		}, expectations{}, "maxSurge 1 maxUnavailable 1; want"},
		{"API server's defaults", func(ds *appsv1.DaemonSet, _ *corev1.Container) { ds.Spec.UpdateStrategy.RollingUpdate = nil }, expectations{}, "maxSurge 0 maxUnavailable 1; want"},
		{"on delete", func(ds *appsv1.DaemonSet, _ *corev1.Container) {
			ds.Spec.UpdateStrategy = appsv1.DaemonSetUpdateStrategy{Type: appsv1.OnDeleteDaemonSetStrategyType}
		}, expectations{}, "updateStrategy OnDelete"},
		{"host port with surge", func(_ *appsv1.DaemonSet, c *corev1.Container) { c.Ports[0].HostPort = 9809 }, expectations{}, "hostPort 9809 with maxSurge 1"},
		{"loopback endpoint", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			setArg(c, "--http-endpoint", "--http-endpoint=127.0.0.1:9809")
		}, expectations{}, "pod IP"},
		{"probe on another port", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			c.ReadinessProbe.HTTPGet.Port = intstr.FromInt32(9810)
		}, expectations{}, `readinessProbe: port 9810 is "9810"; multireg listens on "9809"`},
		{"probe on a port name nobody declares", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			c.ReadinessProbe.HTTPGet.Port = intstr.FromString("metrics")
		}, expectations{}, `readinessProbe: port metrics is ""`},
		{"liveness on readyz", func(_ *appsv1.DaemonSet, c *corev1.Container) { c.LivenessProbe.HTTPGet.Path = readyzPath }, expectations{}, "livenessProbe: path /readyz"},
		{"text logs", func(_ *appsv1.DaemonSet, c *corev1.Container) { setArg(c, "--log-format", "--log-format=text") }, expectations{}, "--log-format"},
		{"capability added", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			c.SecurityContext.Capabilities.Add = []corev1.Capability{"SYS_ADMIN"}
		}, expectations{}, "capabilities"},
		{"writable root", func(_ *appsv1.DaemonSet, c *corev1.Container) { *c.SecurityContext.ReadOnlyRootFilesystem = false }, expectations{}, "readOnlyRootFilesystem"},
		{"host network", func(ds *appsv1.DaemonSet, _ *corev1.Container) { ds.Spec.Template.Spec.HostNetwork = true }, expectations{}, "hostNetwork"},
		// The health checks (healthChecks in the chart): the host's network, and no port.
		{"health checks, as the chart serves them", healthChecks(false), expectations{healthChecks: true}, ""},
		{"health checks with a port", healthChecks(true), expectations{healthChecks: true}, "hostPort 9809 with maxSurge 1"},
		{"health checks with a port, old pod first", func(ds *appsv1.DaemonSet, c *corev1.Container) {
			healthChecks(true)(ds, c)
			oldPodFirst(ds, c)
		}, expectations{healthChecks: true, noSurge: true}, "each becomes a hostPort"},
		{"health checks on the pod's network", func(ds *appsv1.DaemonSet, c *corev1.Container) {
			healthChecks(false)(ds, c)
			ds.Spec.Template.Spec.HostNetwork = false
		}, expectations{healthChecks: true}, "the health checks need the host's network"},
		{"health checks without ClusterFirstWithHostNet", func(ds *appsv1.DaemonSet, c *corev1.Container) {
			healthChecks(false)(ds, c)
			ds.Spec.Template.Spec.DNSPolicy = ""
		}, expectations{healthChecks: true}, "ClusterFirstWithHostNet"},
		{"health checks on loopback", func(ds *appsv1.DaemonSet, c *corev1.Container) {
			healthChecks(false)(ds, c)
			setArg(c, "--health-endpoint", "--health-endpoint=127.0.0.1:9810")
		}, expectations{healthChecks: true}, "every address of the node"},
		{"health endpoint without the host's network", func(_ *appsv1.DaemonSet, c *corev1.Container) {
			c.Args = append(c.Args, "--health-endpoint=:9810")
		}, expectations{}, "without the host's network"},
		{"some taints only", func(ds *appsv1.DaemonSet, _ *corev1.Container) {
			ds.Spec.Template.Spec.Tolerations = []corev1.Toleration{{Key: "node-role.kubernetes.io/control-plane", Operator: corev1.TolerationOpExists}}
		}, expectations{}, "tolerations"},
		{"checksum annotation", func(ds *appsv1.DaemonSet, _ *corev1.Container) {
			ds.Spec.Template.Annotations = map[string]string{checksumConfig: "0"}
		}, expectations{}, checksumConfig},
		{"selector misses pods", func(ds *appsv1.DaemonSet, _ *corev1.Container) {
			ds.Spec.Template.Labels = map[string]string{"app": "other"}
		}, expectations{}, "does not select"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := manifests{daemonSets: []*appsv1.DaemonSet{good.daemonSets[0].DeepCopy()}, configMaps: good.configMaps}
			d, err := deploymentOf(m)
			if err != nil {
				t.Fatal(err)
			}
			tt.break_(d.ds, d.container)
			probs := d.problems(tt.want)
			if tt.wantP == "" {
				if len(probs) > 0 {
					t.Fatalf("problems in the unchanged examples:\n%s", strings.Join(probs, "\n"))
				}
				return
			}
			if !slices.ContainsFunc(probs, func(p string) bool { return strings.Contains(p, tt.wantP) }) {
				t.Fatalf("no problem mentions %q; got:\n%s", tt.wantP, strings.Join(probs, "\n"))
			}
		})
	}
}

// TestArgsRejected shows that checkArgs can fail: multireg refuses what it does not know.
func TestArgsRejected(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"valid", []string{"run", "--config", "/etc/multireg/config.yaml", "--http-endpoint=:9809", "--log-format=json", "-v=1", "--cleanup-on-exit"}, ""},
		{"unknown flag", []string{"run", "--config=/etc/multireg/config.yaml", "--health-port=9809"}, "exit 2"},
		{"bad value", []string{"run", "--config=/etc/multireg/config.yaml", "-v=debug"}, "exit 2"},
		{"stray argument", []string{"run", "--config=/etc/multireg/config.yaml", "json"}, "exit 2"},
		{"unknown command", []string{"serve", "--config=/etc/multireg/config.yaml"}, "exit 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkErr(t, checkArgs(t, tt.args), tt.want)
		})
	}
}

// TestValidateRejects shows that multireg's validation, which every shipped drivers file passes,
// can fail: a broken copy of examples/config.yaml is refused with the field at fault.
func TestValidateRejects(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "examples", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, old, new, want string
	}{
		{"relative endpoint", "endpoint: /var/lib/kubelet/plugins/csi-nfsplugin/csi.sock", "endpoint: csi.sock", `drivers[0].endpoint: "csi.sock": must be an absolute path`},
		{"misspelt field", "    socketName:", "    socketname:", "drivers[3].socketname"},
		{"unknown type", "type: DRAPlugin", "type: DRA", "drivers[2].type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !bytes.Contains(b, []byte(tt.old)) {
				t.Fatalf("examples/config.yaml has no %q", tt.old)
			}
			err := validate(t, "broken.yaml", bytes.Replace(b, []byte(tt.old), []byte(tt.new), 1))
			checkErr(t, err, tt.want)
		})
	}
}
