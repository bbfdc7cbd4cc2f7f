package nodecond

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/validation"
)

// What the reporter reads of its Node and CSINode objects, decoded from the API's JSON into
// types of its own (kubeapi says why not client-go's typed clients).

// condition is one condition of a Node's status, as the reporter reads and writes it.
type condition struct {
	Type               string    `json:"type"`
	Status             string    `json:"status"`
	Reason             string    `json:"reason,omitempty"`
	Message            string    `json:"message,omitempty"`
	LastTransitionTime time.Time `json:"lastTransitionTime,omitzero"`
	LastHeartbeatTime  time.Time `json:"lastHeartbeatTime,omitzero"`
}

// Taint is a taint of a Node's spec: the startup taint the reporter removes.
type Taint struct {
	Key    string `json:"key"`
	Value  string `json:"value,omitempty"`
	Effect string `json:"effect"`
}

func (t Taint) String() string {
	s := t.Key
	if t.Value != "" {
		s += "=" + t.Value
	}
	return s + ":" + t.Effect
}

// Matches reports whether o is t: the same key and effect, and the same value when t names
// one.
func (t Taint) Matches(o Taint) bool {
	return t.Key == o.Key && t.Effect == o.Effect && (t.Value == "" || t.Value == o.Value)
}

// ParseTaint parses KEY[=VALUE]:EFFECT, as kubectl taint and kubelet's --register-with-taints
// write a taint, and checks it as the API server would.
func ParseTaint(s string) (Taint, error) {
	kv, effect, ok := strings.Cut(s, ":")
	if !ok || strings.Contains(effect, ":") {
		return Taint{}, fmt.Errorf("%q: want KEY[=VALUE]:EFFECT", s)
	}
	key, value, _ := strings.Cut(kv, "=")
	t := Taint{Key: key, Value: value, Effect: effect}
	if errs := validation.IsQualifiedName(key); len(errs) > 0 {
		return t, fmt.Errorf("%q: key %q: %s", s, key, strings.Join(errs, "; "))
	}
	if errs := validation.IsValidLabelValue(value); len(errs) > 0 {
		return t, fmt.Errorf("%q: value %q: %s", s, value, strings.Join(errs, "; "))
	}
	switch effect {
	case "NoSchedule", "PreferNoSchedule", "NoExecute":
	default:
		return t, fmt.Errorf("%q: effect %q: must be NoSchedule, PreferNoSchedule or NoExecute", s, effect)
	}
	return t, nil
}

// CheckConditionType checks the node condition's type: a qualified name with a DNS prefix
// (multireg.dev/PluginsRegistered), so that it is never one of kubelet's own (Ready,
// MemoryPressure, …), which have none.
func CheckConditionType(t string) error {
	if errs := validation.IsQualifiedName(t); len(errs) > 0 {
		return fmt.Errorf("%q: %s", t, strings.Join(errs, "; "))
	}
	if !strings.Contains(t, "/") {
		return fmt.Errorf("%q: give it a domain prefix (e.g. multireg.dev/%s): kubelet's own conditions have none", t, t)
	}
	return nil
}

// node is what the reporter reads of its Node: whether it exists, the condition of its type,
// and its taints (as the API server gave them, for a patch that tests them).
type node struct {
	exists bool
	cond   *condition
	taints []json.RawMessage
}

// readNode decodes what the reporter reads of obj (nil: no such node) for condition type typ.
func readNode(obj *unstructured.Unstructured, typ string) (node, error) {
	if obj == nil {
		return node{}, nil
	}
	var n struct {
		Spec struct {
			Taints []json.RawMessage `json:"taints"`
		} `json:"spec"`
		Status struct {
			Conditions []condition `json:"conditions"`
		} `json:"status"`
	}
	b, err := json.Marshal(obj.Object)
	if err != nil {
		return node{}, err
	}
	if err := json.Unmarshal(b, &n); err != nil {
		return node{}, err
	}
	out := node{exists: true, taints: n.Spec.Taints}
	for _, c := range n.Status.Conditions {
		if c.Type == typ {
			out.cond = &c
		}
	}
	return out, nil
}

// hasTaint reports whether the node has a taint t matches.
func (n node) hasTaint(t Taint) bool {
	for _, raw := range n.taints {
		var o Taint
		if json.Unmarshal(raw, &o) == nil && t.Matches(o) {
			return true
		}
	}
	return false
}

// withoutTaint is the node's taints less those t matches.
func (n node) withoutTaint(t Taint) []json.RawMessage {
	out := []json.RawMessage{}
	for _, raw := range n.taints {
		var o Taint
		if json.Unmarshal(raw, &o) == nil && t.Matches(o) {
			continue
		}
		out = append(out, raw)
	}
	return out
}

// readCSINode returns the names of the drivers obj (a CSINode; nil: none) lists.
func readCSINode(obj *unstructured.Unstructured) ([]string, error) {
	if obj == nil {
		return nil, nil
	}
	v, _, err := unstructured.NestedFieldNoCopy(obj.Object, "spec", "drivers")
	if err != nil || v == nil { // no drivers: the API server writes null for an empty list
		return nil, err
	}
	drivers, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("CSINode %s: spec.drivers is %T, not a list", obj.GetName(), v)
	}
	var names []string
	for _, d := range drivers {
		m, ok := d.(map[string]any)
		if !ok {
			continue
		}
		if name, ok := m["name"].(string); ok {
			names = append(names, name)
		}
	}
	return names, nil
}
