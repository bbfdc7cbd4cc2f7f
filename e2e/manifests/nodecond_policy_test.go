package manifests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/cel/environment"
)

// The chart's ValidatingAdmissionPolicy, compiled and evaluated by the API server's own code
// (k8s.io/apiserver's validating admission policy plugin, as kube-apiserver 1.37 compiles a
// policy: compilePolicy in plugin.go, with the expressions checked as a new policy's are),
// against the requests multireg makes and those it must refuse.

// nodeNameExtra is the user extra in which the API server names the node of a pod's token.
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// compiledPolicy is the chart's policy ready to evaluate requests.
type compiledPolicy struct {
	policy    *admissionregistrationv1.ValidatingAdmissionPolicy
	validator validating.Validator
}

// compilePolicy compiles p as kube-apiserver does (its compilePolicy), and fails the test on any
// expression that does not compile as a new policy's expressions must.
func compilePolicy(t *testing.T, p *admissionregistrationv1.ValidatingAdmissionPolicy) compiledPolicy {
	t.Helper()
	cp, err := compile(p)
	if err != nil {
		t.Fatal(err)
	}
	return cp
}

// compile is compilePolicy's work: an error names every expression that does not compile.
func compile(p *admissionregistrationv1.ValidatingAdmissionPolicy) (compiledPolicy, error) {
	envSet := environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion())
	compiler, err := plugincel.NewCompositedCompiler(envSet)
	if err != nil {
		return compiledPolicy{}, err
	}
	vars := make([]plugincel.NamedExpressionAccessor, len(p.Spec.Variables))
	for i, v := range p.Spec.Variables {
		vars[i] = &validating.Variable{Name: v.Name, Expression: v.Expression}
	}
	compiler.CompileAndStoreVariables(vars, plugincel.OptionalVariableDeclarations{HasAuthorizer: true}, environment.NewExpressions)

	// Every expression on its own first, as a new policy's are checked, for an error that names
	// it.
	var errs []error
	check := func(what string, e plugincel.ExpressionAccessor, withAuthorizer bool) {
		r := compiler.CompileCELExpression(e, plugincel.OptionalVariableDeclarations{HasAuthorizer: withAuthorizer}, environment.NewExpressions)
		if r.Error != nil {
			errs = append(errs, fmt.Errorf("%s %q does not compile: %v", what, e.GetExpression(), r.Error))
		}
	}
	for _, v := range p.Spec.Variables {
		check("variable "+v.Name, &validating.Variable{Name: v.Name, Expression: v.Expression}, true)
	}
	var conds, messages []plugincel.ExpressionAccessor
	for _, v := range p.Spec.Validations {
		c := &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason}
		check("validation", c, true)
		conds = append(conds, c)
		var m plugincel.ExpressionAccessor
		if v.MessageExpression != "" {
			mc := &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression}
			check("messageExpression", mc, false)
			m = mc
		}
		messages = append(messages, m)
	}
	var matchers []plugincel.ExpressionAccessor
	for i := range p.Spec.MatchConditions {
		mc := (*matchconditions.MatchCondition)(&p.Spec.MatchConditions[i])
		check("matchCondition", mc, true)
		matchers = append(matchers, mc)
	}
	if len(errs) > 0 {
		return compiledPolicy{}, errors.Join(errs...)
	}
	opts := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	var matcher matchconditions.Matcher
	if len(matchers) > 0 {
		matcher = matchconditions.NewMatcher(compiler.CompileCondition(matchers, opts, environment.StoredExpressions), p.Spec.FailurePolicy, "policy", "validate", p.Name)
	}
	v := validating.NewValidator(
		compiler.CompileCondition(conds, opts, environment.StoredExpressions),
		matcher,
		compiler.CompileCondition(nil, opts, environment.StoredExpressions),
		compiler.CompileCondition(messages, plugincel.OptionalVariableDeclarations{}, environment.StoredExpressions),
		p.Spec.FailurePolicy,
		nil,
	)
	return compiledPolicy{policy: p, validator: v}, nil
}

// request is an UPDATE of a node (a PATCH is one to admission), of its status or of the node.
type request struct {
	user        user.Info
	subresource string // "status" or ""
	old, new    *corev1.Node
}

// verdict is what the policy decides of a request: not matched (another user), admitted, or
// refused with a message; an evaluation error is a failure of the test.
type verdict struct {
	matched bool
	denied  []string // the messages of the validations that refused it
	errors  []string
}

func (p compiledPolicy) decide(t *testing.T, r request) verdict {
	t.Helper()
	gvk := corev1.SchemeGroupVersion.WithKind("Node")
	gvr := corev1.SchemeGroupVersion.WithResource("nodes")
	attrs := admission.NewAttributesRecord(r.new, r.old, gvk, "", r.new.Name, gvr, r.subresource, admission.Update, &metav1.UpdateOptions{}, false, r.user)
	va := &admission.VersionedAttributes{
		Attributes:         attrs,
		VersionedKind:      gvk,
		VersionedObject:    admission.NewLazyObject(r.new),
		VersionedOldObject: admission.NewLazyObject(r.old),
	}
	res := p.validator.Validate(context.Background(), gvr, va, nil, nil, celconfig.RuntimeCELCostBudget, nil)
	v := verdict{matched: len(res.Decisions) > 0}
	for _, d := range res.Decisions {
		switch {
		case d.Evaluation == validating.EvalError:
			v.errors = append(v.errors, d.Message)
		case d.Action == validating.ActionDeny:
			if d.Reason != metav1.StatusReasonForbidden {
				v.errors = append(v.errors, fmt.Sprintf("reason %s, not Forbidden: %s", d.Reason, d.Message))
			}
			v.denied = append(v.denied, d.Message)
		}
	}
	return v
}

// renderPolicy renders the chart with values and returns its one policy.
func renderPolicy(t *testing.T, values string) *admissionregistrationv1.ValidatingAdmissionPolicy {
	t.Helper()
	_, m := renderDeployment(t, values)
	if len(m.policies) != 1 {
		t.Fatalf("%d policies rendered; want 1", len(m.policies))
	}
	return m.policies[0]
}

// sampleNode is a node as kubelet reports it, with a startup taint and kubelet's conditions.
func sampleNode(name string) *corev1.Node {
	t0 := metav1.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	return &corev1.Node{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
		ObjectMeta: metav1.ObjectMeta{
			Name: name, UID: types.UID("uid-" + name), ResourceVersion: "42",
			Labels:      map[string]string{"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
			Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0"},
		},
		Spec: corev1.NodeSpec{
			PodCIDR: "10.244.0.0/24", PodCIDRs: []string{"10.244.0.0/24"},
			Taints: []corev1.Taint{
				{Key: "multireg.dev/plugins-not-ready", Effect: corev1.TaintEffectNoSchedule},
				{Key: "example.com/boot", Value: "plugins", Effect: corev1.TaintEffectNoExecute, TimeAdded: &t0},
				{Key: "dedicated", Value: "storage", Effect: corev1.TaintEffectNoSchedule},
			},
		},
		Status: corev1.NodeStatus{
			Capacity:    corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourcePods: resource.MustParse("110")},
			Allocatable: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("3800m"), corev1.ResourcePods: resource.MustParse("110")},
			Conditions: []corev1.NodeCondition{
				{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientMemory", LastHeartbeatTime: t0, LastTransitionTime: t0},
				{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: t0, LastTransitionTime: t0},
			},
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "192.0.2.10"}},
			NodeInfo:  corev1.NodeSystemInfo{KubeletVersion: "v1.37.2", OperatingSystem: "linux", Architecture: "amd64"},
		},
	}
}

// patched returns node with a strategic merge patch applied (as the API server applies
// multireg's patch of nodes/status), or with edit applied.
func patched(t *testing.T, node *corev1.Node, smp string, edit func(*corev1.Node)) *corev1.Node {
	t.Helper()
	n := node.DeepCopy()
	if smp != "" {
		orig, err := json.Marshal(n)
		if err != nil {
			t.Fatal(err)
		}
		b, err := strategicpatch.StrategicMergePatch(orig, []byte(smp), corev1.Node{})
		if err != nil {
			t.Fatal(err)
		}
		n = &corev1.Node{}
		if err := json.Unmarshal(b, n); err != nil {
			t.Fatal(err)
		}
	}
	if edit != nil {
		edit(n)
	}
	return n
}

// conditionPatch is multireg's patch of nodes/status: its one condition, merged by type.
func conditionPatch(typ, status string) string {
	return fmt.Sprintf(`{"status":{"conditions":[{"type":%q,"status":%q,"reason":"RequiredPluginsRegistered","message":"kubelet holds every required plugin (2)","lastHeartbeatTime":"2026-01-02T03:05:00Z","lastTransitionTime":"2026-01-02T03:05:00Z"}]}}`, typ, status)
}

func TestNodeConditionPolicy(t *testing.T) {
	const sa = "system:serviceaccount:" + releaseNamespace + ":multireg"
	onNode := func(node string) user.Info {
		return &user.DefaultInfo{Name: sa, Groups: []string{"system:serviceaccounts", "system:authenticated"},
			Extra: map[string][]string{nodeNameExtra: {node}, "authentication.kubernetes.io/pod-name": {"multireg-x"}}}
	}
	unbound := &user.DefaultInfo{Name: sa, Groups: []string{"system:serviceaccounts", "system:authenticated"}}
	emptyExtra := &user.DefaultInfo{Name: sa, Extra: map[string][]string{nodeNameExtra: {}}}
	otherSA := &user.DefaultInfo{Name: "system:serviceaccount:other:multireg", Extra: map[string][]string{nodeNameExtra: {"node-a"}}}
	kubelet := &user.DefaultInfo{Name: "system:node:node-b", Groups: []string{"system:nodes"}}
	nodeA, nodeB := sampleNode("node-a"), sampleNode("node-b")
	withoutTaint := func(key string) func(*corev1.Node) {
		return func(n *corev1.Node) {
			var kept []corev1.Taint
			for _, tn := range n.Spec.Taints {
				if tn.Key != key {
					kept = append(kept, tn)
				}
			}
			n.Spec.Taints = kept
		}
	}

	type tc struct {
		name    string
		req     request
		matched bool
		denied  string // in the refusal's messages; "" for admitted
	}
	statusCases := func(typ string) []tc {
		return []tc{
			{"its own condition on its own node", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, conditionPatch(typ, "True"), nil)}, true, ""},
			{"its own condition again, False", request{onNode("node-a"), "status", patched(t, nodeA, conditionPatch(typ, "True"), nil), patched(t, nodeA, conditionPatch(typ, "False"), nil)}, true, ""},
			{"another node", request{onNode("node-a"), "status", nodeB, patched(t, nodeB, conditionPatch(typ, "True"), nil)}, true,
				"changes only the node its pod runs on, node-a, not node-b"},
			{"a token bound to no pod", request{unbound, "status", nodeA, patched(t, nodeA, conditionPatch(typ, "True"), nil)}, true,
				"this request's token names no node"},
			{"an empty node-name extra", request{emptyExtra, "status", nodeA, patched(t, nodeA, conditionPatch(typ, "True"), nil)}, true,
				"this request's token names no node"},
			{"kubelet's condition", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, conditionPatch("Ready", "False"), nil)}, true,
				"nothing of a node's status but its own condition"},
			{"a condition of another type", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, conditionPatch("example.com/Other", "True"), nil)}, true,
				"nothing of a node's status but its own condition"},
			{"the capacity", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, `{"status":{"capacity":{"example.com/gpu":"8"}}}`, nil)}, true,
				"nothing of a node's status but its own condition"},
			{"a status field a later Kubernetes adds", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, "", func(n *corev1.Node) { n.Status.Phase = "Running" })}, true,
				"nothing of a node's status but its own condition"},
			{"a label, through the status", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, `{"metadata":{"labels":{"node-role.kubernetes.io/control-plane":""}}}`, nil)}, true,
				"no label, annotation, owner or finalizer"},
			{"an annotation removed, through the status", request{onNode("node-a"), "status", nodeA, patched(t, nodeA, `{"metadata":{"annotations":null}}`, nil)}, true,
				"no label, annotation, owner or finalizer"},
			{"another namespace's account", request{otherSA, "status", nodeB, patched(t, nodeB, conditionPatch("Ready", "False"), nil)}, false, ""},
			{"kubelet", request{kubelet, "status", nodeB, patched(t, nodeB, conditionPatch("Ready", "False"), nil)}, false, ""},
		}
	}
	run := func(t *testing.T, p compiledPolicy, cases []tc) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				v := p.decide(t, c.req)
				if len(v.errors) > 0 {
					t.Fatalf("evaluation errors (with failurePolicy Fail, a refusal that says nothing): %q", v.errors)
				}
				if v.matched != c.matched {
					t.Fatalf("matched %v; want %v", v.matched, c.matched)
				}
				switch {
				case c.denied == "" && len(v.denied) > 0:
					t.Errorf("refused: %q", v.denied)
				case c.denied != "" && !strings.Contains(strings.Join(v.denied, "\n"), c.denied):
					t.Errorf("refusals %q; want one that says %q", v.denied, c.denied)
				}
			})
		}
	}

	t.Run("no startup taint", func(t *testing.T) {
		p := compilePolicy(t, renderPolicy(t, ""))
		run(t, p, append(statusCases(defaultConditionType),
			tc{"a taint removed", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", withoutTaint("multireg.dev/plugins-not-ready"))}, true,
				"it has no startup taint to remove"},
		))
	})
	t.Run("startup taint", func(t *testing.T) {
		p := compilePolicy(t, renderPolicy(t, "nodeCondition: {startupTaint: "+testStartupTaint+"}"))
		run(t, p, append(statusCases(defaultConditionType),
			tc{"the startup taint removed", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", withoutTaint("multireg.dev/plugins-not-ready"))}, true, ""},
			tc{"the startup taint already gone", request{onNode("node-a"), "", patched(t, nodeA, "", withoutTaint("multireg.dev/plugins-not-ready")), patched(t, nodeA, "", withoutTaint("multireg.dev/plugins-not-ready"))}, true, ""},
			tc{"every taint gone but the startup taint's removal", request{onNode("node-a"), "", patched(t, nodeA, "", func(n *corev1.Node) { n.Spec.Taints = n.Spec.Taints[:1] }), patched(t, nodeA, "", func(n *corev1.Node) { n.Spec.Taints = nil })}, true, ""},
			tc{"the startup taint removed from another node", request{onNode("node-a"), "", nodeB, patched(t, nodeB, "", withoutTaint("multireg.dev/plugins-not-ready"))}, true,
				"changes only the node its pod runs on, node-a, not node-b"},
			tc{"another taint removed", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", withoutTaint("dedicated"))}, true,
				"but the removal of its startup taint, " + testStartupTaint},
			tc{"a taint added", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", func(n *corev1.Node) {
				n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "x", Effect: corev1.TaintEffectNoExecute})
			})}, true, "but the removal of its startup taint"},
			tc{"cordoned", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", func(n *corev1.Node) { n.Spec.Unschedulable = true })}, true,
				"but the removal of its startup taint"},
			tc{"the provider ID", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", func(n *corev1.Node) { n.Spec.ProviderID = "aws:///x" })}, true,
				"but the removal of its startup taint"},
			tc{"a label", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", func(n *corev1.Node) { n.Labels["x"] = "y" })}, true,
				"no label, annotation, owner or finalizer"},
			tc{"a finalizer", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", func(n *corev1.Node) { n.Finalizers = []string{"x"} })}, true,
				"no label, annotation, owner or finalizer"},
			tc{"the taint, by a token bound to no pod", request{unbound, "", nodeA, patched(t, nodeA, "", withoutTaint("multireg.dev/plugins-not-ready"))}, true,
				"this request's token names no node"},
		))
	})
	t.Run("startup taint with a value", func(t *testing.T) {
		p := compilePolicy(t, renderPolicy(t, "nodeCondition: {startupTaint: 'example.com/boot=plugins:NoExecute'}"))
		otherValue := patched(t, nodeA, "", func(n *corev1.Node) { n.Spec.Taints[1].Value = "other" })
		run(t, p, []tc{
			{"the startup taint removed", request{onNode("node-a"), "", nodeA, patched(t, nodeA, "", withoutTaint("example.com/boot"))}, true, ""},
			{"the key with another value", request{onNode("node-a"), "", otherValue, patched(t, otherValue, "", withoutTaint("example.com/boot"))}, true,
				"but the removal of its startup taint, example.com/boot=plugins:NoExecute"},
		})
	})
	t.Run("another type and service account", func(t *testing.T) {
		p := compilePolicy(t, renderPolicy(t, "nodeCondition: {type: example.com/DriversReady}\nserviceAccount: {name: registrar}"))
		registrar := &user.DefaultInfo{Name: "system:serviceaccount:" + releaseNamespace + ":registrar", Extra: map[string][]string{nodeNameExtra: {"node-a"}}}
		run(t, p, []tc{
			{"its own condition", request{registrar, "status", nodeA, patched(t, nodeA, conditionPatch("example.com/DriversReady", "True"), nil)}, true, ""},
			{"the default type's condition", request{registrar, "status", nodeA, patched(t, nodeA, conditionPatch(defaultConditionType, "True"), nil)}, true,
				"nothing of a node's status but its own condition, example.com/DriversReady"},
			{"the default account", request{onNode("node-b"), "status", nodeA, patched(t, nodeA, conditionPatch(defaultConditionType, "True"), nil)}, false, ""},
		})
	})
}

// TestNodeConditionPolicyCatchesErrors shows that the harness fails a broken policy: an
// expression that does not compile, and one that errs at evaluation (a field read without
// has()), which failurePolicy Fail turns into a refusal that explains nothing.
func TestNodeConditionPolicyCatchesErrors(t *testing.T) {
	p := renderPolicy(t, "")
	broken := p.DeepCopy()
	broken.Spec.Validations[0].Expression = "variables.tokenNode !="
	if _, err := compile(broken); err == nil || !strings.Contains(err.Error(), "does not compile") {
		t.Errorf("a policy with an expression that does not compile: error %v", err)
	}

	erring := p.DeepCopy()
	erring.Spec.Validations[0].Expression = "request.userInfo.extra['" + nodeNameExtra + "'][0] != ''"
	cp := compilePolicy(t, erring)
	v := cp.decide(t, request{&user.DefaultInfo{Name: "system:serviceaccount:" + releaseNamespace + ":multireg"}, "status", sampleNode("node-a"), sampleNode("node-a")})
	if len(v.errors) == 0 {
		t.Errorf("an expression that reads an absent extra did not err: %+v", v)
	}
}
