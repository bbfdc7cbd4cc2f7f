package manifests

import (
	"maps"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// The node condition (the chart's nodeCondition, on by default): the DaemonSet's arguments,
// environment and token, and the ClusterRole and its binding (least privilege: exactly these
// rules).

const (
	defaultConditionType = "multireg.dev/PluginsRegistered"
	testStartupTaint     = "multireg.dev/plugins-not-ready:NoSchedule"
)

// roleRules are the rules of the node condition's ClusterRole: each "group/resource verb".
var roleRules = []string{
	"/nodes get", "/nodes list", "/nodes watch",
	"storage.k8s.io/csinodes get", "storage.k8s.io/csinodes list", "storage.k8s.io/csinodes watch",
	"/nodes/status patch",
}

// ruleSet flattens RBAC rules into "group/resource verb" strings, sorted; a rule that names
// resourceNames or nonResourceURLs, or a wildcard, is reported as such so that it never passes.
func ruleSet(rules []rbacv1.PolicyRule) []string {
	var out []string
	for _, r := range rules {
		if len(r.ResourceNames) > 0 || len(r.NonResourceURLs) > 0 {
			out = append(out, "a rule with resourceNames or nonResourceURLs")
		}
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					out = append(out, g+"/"+res+" "+v)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// conditionArgs returns the node condition's arguments of the container, each with how many
// times it is given.
func conditionArgs(args []string) map[string]int {
	n := map[string]int{}
	for _, a := range args {
		for _, f := range []string{"--node-condition", "--node-name", "--startup-taint", "--kubeconfig"} {
			if a == f || strings.HasPrefix(a, f+"=") {
				n[a]++
			}
		}
	}
	return n
}

func TestChartNodeCondition(t *testing.T) {
	tests := []struct {
		name, values string
		enabled      bool
		sa           string // the pods' service account
		saCreated    bool
		condType     string
		taint        string
	}{
		{"default values", "", true, "multireg", true, defaultConditionType, ""},
		{"off", "nodeCondition: {enabled: false}", false, "multireg", true, "", ""},
		{"a startup taint", "nodeCondition: {startupTaint: " + testStartupTaint + "}", true, "multireg", true, defaultConditionType, testStartupTaint},
		{"a startup taint with a value", "nodeCondition: {startupTaint: 'example.com/boot=plugins:NoExecute'}", true, "multireg", true, defaultConditionType, "example.com/boot=plugins:NoExecute"},
		{"another type, a named service account", "nodeCondition: {type: example.com/DriversReady}\nserviceAccount: {name: registrar}", true, "registrar", true, "example.com/DriversReady", ""},
		{"an existing service account", "serviceAccount: {create: false, name: node-agents}", true, "node-agents", false, defaultConditionType, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, m := renderDeployment(t, tt.values)
			spec := d.ds.Spec.Template.Spec
			args := conditionArgs(d.container.Args)
			var nodeName *corev1.EnvVar
			for i, e := range d.container.Env {
				if e.Name == "NODE_NAME" {
					nodeName = &d.container.Env[i]
				}
			}
			if tt.saCreated {
				if len(m.serviceAccounts) != 1 {
					t.Fatalf("%d service accounts; want 1", len(m.serviceAccounts))
				}
				// The account never mounts its token by itself: only the pods that ask do.
				if sa := m.serviceAccounts[0]; sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
					t.Error("the service account automounts its token; want false (the pods ask for it)")
				}
			}

			if !tt.enabled {
				if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
					t.Error("the pods mount a service account token without the node condition")
				}
				if len(args) != 0 || nodeName != nil || d.container.Env != nil {
					t.Errorf("the node condition's args %v, env %+v without it; want none", args, d.container.Env)
				}
				if n := len(m.clusterRoles) + len(m.clusterRoleBindings) + len(m.policies) + len(m.policyBindings); n != 0 {
					t.Errorf("%d RBAC and admission objects without the node condition; want none", n)
				}
				return
			}

			// The pod: its token, its node's name, the arguments.
			if spec.AutomountServiceAccountToken == nil || !*spec.AutomountServiceAccountToken {
				t.Error("the pods do not mount their token: multireg cannot reach the API server")
			}
			if nodeName == nil || nodeName.Value != "" || nodeName.ValueFrom == nil || nodeName.ValueFrom.FieldRef == nil ||
				nodeName.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
				t.Errorf("env NODE_NAME %+v; want the downward API's spec.nodeName", nodeName)
			}
			want := map[string]int{"--node-condition=" + tt.condType: 1, "--node-name=$(NODE_NAME)": 1}
			if tt.taint != "" {
				want["--startup-taint="+tt.taint] = 1
			}
			if !maps.Equal(args, want) {
				t.Errorf("the node condition's args %v; want %v", args, want)
			}

			// RBAC: exactly the rules the condition needs, bound to the pods' account.
			if len(m.clusterRoles) != 1 || len(m.clusterRoleBindings) != 1 {
				t.Fatalf("%d ClusterRoles, %d ClusterRoleBindings; want one of each", len(m.clusterRoles), len(m.clusterRoleBindings))
			}
			role, binding := m.clusterRoles[0], m.clusterRoleBindings[0]
			wantRules := slices.Clone(roleRules)
			if tt.taint != "" {
				wantRules = append(wantRules, "/nodes patch")
			}
			slices.Sort(wantRules)
			if got := ruleSet(role.Rules); !slices.Equal(got, wantRules) {
				t.Errorf("ClusterRole rules %q; want exactly %q", got, wantRules)
			}
			if role.AggregationRule != nil {
				t.Errorf("ClusterRole aggregates %+v; want its own rules only", role.AggregationRule)
			}
			if binding.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name}) {
				t.Errorf("ClusterRoleBinding roleRef %+v; want the ClusterRole %s", binding.RoleRef, role.Name)
			}
			wantSubject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: tt.sa, Namespace: releaseNamespace}
			if len(binding.Subjects) != 1 || binding.Subjects[0] != wantSubject {
				t.Errorf("ClusterRoleBinding subjects %+v; want only %+v", binding.Subjects, wantSubject)
			}
			if spec.ServiceAccountName != tt.sa {
				t.Errorf("the pods' service account %q; the binding's %q", spec.ServiceAccountName, tt.sa)
			}

			if n := len(m.policies) + len(m.policyBindings); n != 0 {
				t.Errorf("%d admission policies and bindings; want none", n)
			}

			// Cluster-wide objects: no namespace, the chart's labels.
			for _, o := range []struct {
				kind, name, namespace string
				labels                map[string]string
			}{
				{"ClusterRole", role.Name, role.Namespace, role.Labels},
				{"ClusterRoleBinding", binding.Name, binding.Namespace, binding.Labels},
			} {
				if o.namespace != "" || o.labels["app.kubernetes.io/instance"] != releaseName {
					t.Errorf("%s %s: namespace %q, labels %v; want none, and the chart's", o.kind, o.name, o.namespace, o.labels)
				}
			}
		})
	}
}

// TestChartNodeConditionRejects feeds the chart node-condition values it must refuse.
func TestChartNodeConditionRejects(t *testing.T) {
	checkRenders(t, loadChart(t), []renderCase{
		{"a type without a domain", "nodeCondition: {type: PluginsRegistered}", "at '/nodeCondition/type'"},
		{"a type with a space", "nodeCondition: {type: 'multireg.dev/Plugins Registered'}", "at '/nodeCondition/type'"},
		{"a type with an upper-case domain", "nodeCondition: {type: Multireg.dev/PluginsRegistered}", "at '/nodeCondition/type'"},
		{"an empty type", "nodeCondition: {type: ''}", "at '/nodeCondition/type'"},
		{"a taint without an effect", "nodeCondition: {startupTaint: multireg.dev/plugins-not-ready}", "at '/nodeCondition/startupTaint'"},
		{"a taint of an unknown effect", "nodeCondition: {startupTaint: 'multireg.dev/plugins-not-ready:NoScheduling'}", "at '/nodeCondition/startupTaint'"},
		{"a taint with two effects", "nodeCondition: {startupTaint: 'a:NoSchedule:NoExecute'}", "at '/nodeCondition/startupTaint'"},
		{"a taint without a key", "nodeCondition: {startupTaint: ':NoSchedule'}", "at '/nodeCondition/startupTaint'"},
		{"a taint with a value", "nodeCondition: {startupTaint: 'example.com/boot=plugins:NoExecute'}", ""},
		{"a taint with an empty value", "nodeCondition: {startupTaint: 'boot=:PreferNoSchedule'}", ""},
		{"a taint with the condition off", "nodeCondition: {enabled: false, startupTaint: '" + testStartupTaint + "'}",
			`nodeCondition.startupTaint "` + testStartupTaint + `": multireg removes it only with the node condition`},
		{"a misspelt value", "nodeCondition: {startupTaints: x}", "additional properties 'startupTaints' not allowed"},
		{"enabled not a boolean", "nodeCondition: {enabled: 'no'}", "at '/nodeCondition/enabled'"},
	})
}

// TestChartNodeConditionArgsAccepted: multireg accepts the node condition's command line as
// kubelet gives it, $(NODE_NAME) expanded (checkDeployment does so for every render).
func TestChartNodeConditionArgsAccepted(t *testing.T) {
	for _, values := range []string{
		"",
		"nodeCondition: {startupTaint: " + testStartupTaint + "}",
		"nodeCondition: {type: example.com/DriversReady, startupTaint: 'example.com/boot=plugins:NoExecute'}",
	} {
		d, _ := renderDeployment(t, values)
		args := expandArgs(d.container)
		if !slices.Contains(args, "--node-name="+sampleNodeName) {
			t.Errorf("%q: args %q after expansion; want --node-name=%s", values, args, sampleNodeName)
		}
		if err := checkArgs(t, args); err != nil {
			t.Errorf("%q: %v", values, err)
		}
	}
}
