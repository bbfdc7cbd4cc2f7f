package manifests

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
	"slices"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8sjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	kustomize "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/yaml"
)

// repoRoot is the product repository: two levels above this package.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("no caller information")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// splitDocuments returns the non-empty YAML documents of a stream. A document that holds only
// comments is empty.
func splitDocuments(b []byte) ([][]byte, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		var v any
		if err := yaml.Unmarshal(doc, &v); err != nil {
			return nil, fmt.Errorf("document %d: %w", len(docs)+1, err)
		}
		if v != nil {
			docs = append(docs, doc)
		}
	}
}

// typeMeta is a document's apiVersion and kind.
type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

func (m typeMeta) String() string { return m.APIVersion + " " + m.Kind }

func typeOf(doc []byte) (typeMeta, error) {
	var m typeMeta
	if err := yaml.Unmarshal(doc, &m); err != nil {
		return m, err
	}
	return m, nil
}

// The kinds a manifest of ours may hold, and where each is decoded.
var (
	kindDaemonSet     = typeMeta{"apps/v1", "DaemonSet"}
	kindConfigMap     = typeMeta{"v1", "ConfigMap"}
	kindSA            = typeMeta{"v1", "ServiceAccount"}
	kindKustomization = typeMeta{"kustomize.config.k8s.io/v1beta1", "Kustomization"}
	kindRegistrar     = typeMeta{"multireg.dev/v1alpha1", "RegistrarConfig"}

	// The node condition's (the chart's nodeCondition): its RBAC and admission policy.
	kindClusterRole        = typeMeta{"rbac.authorization.k8s.io/v1", "ClusterRole"}
	kindClusterRoleBinding = typeMeta{"rbac.authorization.k8s.io/v1", "ClusterRoleBinding"}
	kindPolicy             = typeMeta{"admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"}
	kindPolicyBinding      = typeMeta{"admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"}
)

// strictSerializer decodes the Kubernetes kinds we ship the way a strict API server does
// (kubectl --validate=strict): unknown fields, duplicate fields and wrong types are errors.
var strictSerializer = func() *k8sjson.Serializer {
	scheme := k8sruntime.NewScheme()
	for _, add := range []func(*k8sruntime.Scheme) error{appsv1.AddToScheme, corev1.AddToScheme, rbacv1.AddToScheme, admissionregistrationv1.AddToScheme} {
		if err := add(scheme); err != nil {
			panic(err)
		}
	}
	return k8sjson.NewSerializerWithOptions(k8sjson.DefaultMetaFactory, scheme, scheme,
		k8sjson.SerializerOptions{Yaml: true, Strict: true})
}()

// manifests are the Kubernetes objects of one install (the examples, or one chart render).
type manifests struct {
	daemonSets []*appsv1.DaemonSet
	configMaps []*corev1.ConfigMap
	// serviceAccounts: the chart's own, unless serviceAccount.create is false.
	serviceAccounts []*corev1.ServiceAccount
	// The node condition's objects (the chart's, with nodeCondition.enabled).
	clusterRoles        []*rbacv1.ClusterRole
	clusterRoleBindings []*rbacv1.ClusterRoleBinding
	policies            []*admissionregistrationv1.ValidatingAdmissionPolicy
	policyBindings      []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
}

// decodeObject decodes one Kubernetes document strictly into its k8s.io/api type. Kinds other
// than DaemonSet, ConfigMap, ServiceAccount and the node condition's ClusterRole,
// ValidatingAdmissionPolicy and their bindings are errors: nothing else is shipped.
func decodeObject(doc []byte) (k8sruntime.Object, error) {
	tm, err := typeOf(doc)
	if err != nil {
		return nil, err
	}
	if !slices.Contains([]typeMeta{kindDaemonSet, kindConfigMap, kindSA, kindClusterRole, kindClusterRoleBinding, kindPolicy, kindPolicyBinding}, tm) {
		return nil, fmt.Errorf("unexpected kind %q", tm)
	}
	gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
	obj, _, err := strictSerializer.Decode(doc, &gvk, nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tm, err)
	}
	return obj, nil
}

// decodeManifests decodes every document of a stream strictly.
func decodeManifests(b []byte) (manifests, error) {
	var m manifests
	docs, err := splitDocuments(b)
	if err != nil {
		return m, err
	}
	for i, doc := range docs {
		obj, err := decodeObject(doc)
		if err != nil {
			return m, fmt.Errorf("document %d: %w", i+1, err)
		}
		switch o := obj.(type) {
		case *appsv1.DaemonSet:
			m.daemonSets = append(m.daemonSets, o)
		case *corev1.ConfigMap:
			m.configMaps = append(m.configMaps, o)
		default:
			m.add(obj)
		}
	}
	return m, nil
}

// add files a decoded object of a kind besides the DaemonSet and ConfigMap; it reports
// whether it knew the kind.
func (m *manifests) add(obj k8sruntime.Object) bool {
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		m.serviceAccounts = append(m.serviceAccounts, o)
	case *rbacv1.ClusterRole:
		m.clusterRoles = append(m.clusterRoles, o)
	case *rbacv1.ClusterRoleBinding:
		m.clusterRoleBindings = append(m.clusterRoleBindings, o)
	case *admissionregistrationv1.ValidatingAdmissionPolicy:
		m.policies = append(m.policies, o)
	case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
		m.policyBindings = append(m.policyBindings, o)
	default:
		return false
	}
	return true
}

// decodeKustomization decodes a kustomization file strictly into kustomize's own type.
func decodeKustomization(doc []byte) (*kustomize.Kustomization, error) {
	var k kustomize.Kustomization
	if err := yaml.UnmarshalStrict(doc, &k); err != nil {
		return nil, fmt.Errorf("%s: %w", kindKustomization, err)
	}
	return &k, nil
}

func TestStrictDecodingRejects(t *testing.T) {
	const ds = `apiVersion: apps/v1
kind: DaemonSet
metadata: {name: multireg}
spec:
  selector: {matchLabels: {app: multireg}}
  template:
    metadata: {labels: {app: multireg}}
    spec:
      containers:
        - name: multireg
          image: multireg
`
	tests := []struct {
		name string
		give string
		want string // in the error
	}{
		{"valid", ds, ""},
		{"unknown field", ds + "          imagePullPolicyy: Always\n", `unknown field "spec.template.spec.containers[0].imagePullPolicyy"`},
		{"duplicate field", ds + "          image: other\n", `key "image" already set`},
		{"wrong type", ds + "          ports: {containerPort: 1}\n", "cannot unmarshal"},
		{"unexpected kind", "apiVersion: v1\nkind: Service\nmetadata: {name: multireg}\n", `unexpected kind "v1 Service"`},
		{"misspelt apiVersion", "apiVersion: app/v1\nkind: DaemonSet\nmetadata: {name: multireg}\n", `unexpected kind "app/v1 DaemonSet"`},
		{
			"cluster role with a misspelt field",
			"apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: multireg}\nrules: [{apiGroups: [''], resources: [nodes], verb: [get]}]\n",
			`unknown field "rules[0].verb"`,
		},
		{
			"admission policy with a misspelt field",
			"apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\nmetadata: {name: multireg}\nspec: {validation: [{expression: 'true'}]}\n",
			`unknown field "spec.validation"`,
		},
		{"a role, not a cluster role", "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: multireg}\n", `unexpected kind "rbac.authorization.k8s.io/v1 Role"`},
		{
			"configmap data not strings",
			"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: multireg}\ndata: {config.yaml: {a: 1}}\n",
			"cannot unmarshal",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeManifests([]byte(tt.give))
			checkErr(t, err, tt.want)
		})
	}
}

func TestStrictKustomizationRejects(t *testing.T) {
	tests := []struct {
		name string
		give string
		want string
	}{
		{"valid", "resources: [daemonset.yaml]\nnamespace: kube-system\n", ""},
		{"unknown field", "resources: [daemonset.yaml]\nnamespaces: kube-system\n", `unknown field "namespaces"`},
		{"duplicate field", "resources: [a.yaml]\nresources: [b.yaml]\n", `key "resources" already set`},
		{"generator option misspelt", "configMapGenerator:\n  - name: multireg\n    options: {disableNameSuffixHashes: true}\n", `unknown field "disableNameSuffixHashes"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := decodeKustomization([]byte(tt.give))
			checkErr(t, err, tt.want)
		})
	}
}

// checkErr fails unless err matches want: nil for "", else an error containing want.
func checkErr(t *testing.T, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatalf("unexpected error: %v", err)
	case want != "" && err == nil:
		t.Fatalf("no error; want one containing %q", want)
	case want != "" && !bytes.Contains([]byte(err.Error()), []byte(want)):
		t.Fatalf("error %q does not contain %q", err, want)
	}
}
