package manifests

import (
	"maps"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// The node condition (the chart's nodeCondition, on by default): the DaemonSet's arguments,
// environment and token, the ClusterRole and its binding (least privilege: exactly these rules),
// and the ValidatingAdmissionPolicy that confines the writes to the pod's own node. What the
// policy decides is evaluated by the API server's own CEL code in nodecond_policy_test.go.

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
		policy       bool // the ValidatingAdmissionPolicy and its binding
	}{
		{"default values", "", true, "multireg", true, defaultConditionType, "", true},
		{"off", "nodeCondition: {enabled: false}", false, "multireg", true, "", "", false},
		{"off, with the policy's value left on", "nodeCondition: {enabled: false, validatingAdmissionPolicy: {enabled: true}}", false, "multireg", true, "", "", false},
		{"a startup taint", "nodeCondition: {startupTaint: " + testStartupTaint + "}", true, "multireg", true, defaultConditionType, testStartupTaint, true},
		{"a startup taint with a value", "nodeCondition: {startupTaint: 'example.com/boot=plugins:NoExecute'}", true, "multireg", true, defaultConditionType, "example.com/boot=plugins:NoExecute", true},
		{"no policy", "nodeCondition: {validatingAdmissionPolicy: {enabled: false}}", true, "multireg", true, defaultConditionType, "", false},
		{"another type, a named service account", "nodeCondition: {type: example.com/DriversReady}\nserviceAccount: {name: registrar}", true, "registrar", true, "example.com/DriversReady", "", true},
		{"an existing service account", "serviceAccount: {create: false, name: node-agents}", true, "node-agents", false, defaultConditionType, "", true},
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

			// The admission policy.
			if !tt.policy {
				if len(m.policies)+len(m.policyBindings) != 0 {
					t.Errorf("%d policies and %d bindings; want none", len(m.policies), len(m.policyBindings))
				}
				return
			}
			if len(m.policies) != 1 || len(m.policyBindings) != 1 {
				t.Fatalf("%d ValidatingAdmissionPolicies, %d bindings; want one of each", len(m.policies), len(m.policyBindings))
			}
			p, pb := m.policies[0], m.policyBindings[0]
			if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionregistrationv1.Fail {
				t.Errorf("failurePolicy %v; want Fail: a policy that cannot decide must refuse", p.Spec.FailurePolicy)
			}
			wantRule := admissionregistrationv1.RuleWithOperations{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
				Rule: admissionregistrationv1.Rule{
					APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"nodes", "nodes/status"},
				},
			}
			if mc := p.Spec.MatchConstraints; mc == nil || len(mc.ResourceRules) != 1 || len(mc.ExcludeResourceRules) != 0 ||
				!equalRules(mc.ResourceRules[0].RuleWithOperations, wantRule) || len(mc.ResourceRules[0].ResourceNames) != 0 {
				t.Errorf("matchConstraints %+v; want exactly UPDATE of nodes and nodes/status", mc)
			}
			user := "'system:serviceaccount:" + releaseNamespace + ":" + tt.sa + "'"
			if len(p.Spec.MatchConditions) != 1 || !strings.Contains(p.Spec.MatchConditions[0].Expression, user) {
				t.Errorf("matchConditions %+v; want the one that names %s", p.Spec.MatchConditions, user)
			}
			if p.Spec.ParamKind != nil {
				t.Errorf("paramKind %+v; want none", p.Spec.ParamKind)
			}
			if pb.Spec.PolicyName != p.Name || !slices.Equal(pb.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) ||
				pb.Spec.ParamRef != nil || pb.Spec.MatchResources != nil {
				t.Errorf("binding %+v; want the policy %s, validationActions [Deny], nothing else", pb.Spec, p.Name)
			}
			for _, v := range p.Spec.Validations {
				if v.Reason == nil || *v.Reason != "Forbidden" {
					t.Errorf("validation %q: reason %v; want Forbidden (multireg takes Invalid for a node changed meanwhile)", v.Expression, v.Reason)
				}
			}

			// Cluster-wide objects: no namespace, the chart's labels.
			for _, o := range []struct {
				kind, name, namespace string
				labels                map[string]string
			}{
				{"ClusterRole", role.Name, role.Namespace, role.Labels},
				{"ClusterRoleBinding", binding.Name, binding.Namespace, binding.Labels},
				{"ValidatingAdmissionPolicy", p.Name, p.Namespace, p.Labels},
				{"ValidatingAdmissionPolicyBinding", pb.Name, pb.Namespace, pb.Labels},
			} {
				if o.namespace != "" || o.labels["app.kubernetes.io/instance"] != releaseName {
					t.Errorf("%s %s: namespace %q, labels %v; want none, and the chart's", o.kind, o.name, o.namespace, o.labels)
				}
			}
		})
	}
}

// equalRules compares two admission rules field by field.
func equalRules(a, b admissionregistrationv1.RuleWithOperations) bool {
	return slices.Equal(a.Operations, b.Operations) && slices.Equal(a.APIGroups, b.APIGroups) &&
		slices.Equal(a.APIVersions, b.APIVersions) && slices.Equal(a.Resources, b.Resources) &&
		(a.Scope == nil || *a.Scope == admissionregistrationv1.AllScopes || *a.Scope == admissionregistrationv1.ClusterScope)
}

// TestChartNodeConditionPolicyOptOut: validatingAdmissionPolicy.enabled=false drops the policy
// and its binding, and changes nothing else, byte for byte.
func TestChartNodeConditionPolicyOptOut(t *testing.T) {
	c := loadChart(t)
	for _, taint := range []string{"", testStartupTaint} {
		render := func(policy bool) map[string]string {
			files, err := renderFiles(c, mustValues(t, "nodeCondition: {startupTaint: '"+taint+"', validatingAdmissionPolicy: {enabled: "+map[bool]string{true: "true", false: "false"}[policy]+"}}"))
			if err != nil {
				t.Fatal(err)
			}
			return files
		}
		with, without := render(true), render(false)
		for name, s := range with {
			if strings.HasSuffix(name, "/validatingadmissionpolicy.yaml") {
				if strings.TrimSpace(without[name]) != "" {
					t.Errorf("startupTaint %q: %s renders with the policy off:\n%s", taint, name, without[name])
				}
				if !strings.Contains(s, "kind: ValidatingAdmissionPolicyBinding") {
					t.Errorf("startupTaint %q: %s renders no binding with the policy on", taint, name)
				}
				continue
			}
			if without[name] != s {
				t.Errorf("startupTaint %q: %s differs with the policy off", taint, name)
			}
		}
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
		{"a misspelt policy value", "nodeCondition: {validatingAdmissionPolicy: {enable: false}}", "additional properties 'enable' not allowed"},
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
