package agent

import (
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"multireg.dev/multireg/nodecond"
)

// What the agent reads of its Node and CSINode objects, decoded from the API's JSON into types
// of its own (kubeapi says why not client-go's typed clients).

// condition is one condition of a Node's status, as the reporter reads and writes it.
type condition struct {
	Type               string    `json:"type"`
	Status             string    `json:"status"`
	Reason             string    `json:"reason,omitempty"`
	Message            string    `json:"message,omitempty"`
	LastTransitionTime time.Time `json:"lastTransitionTime,omitzero"`
	LastHeartbeatTime  time.Time `json:"lastHeartbeatTime,omitzero"`
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
func (n node) hasTaint(t nodecond.Taint) bool {
	for _, raw := range n.taints {
		var o nodecond.Taint
		if json.Unmarshal(raw, &o) == nil && t.Matches(o) {
			return true
		}
	}
	return false
}

// withoutTaint is the node's taints less those t matches.
func (n node) withoutTaint(t nodecond.Taint) []json.RawMessage {
	out := []json.RawMessage{}
	for _, raw := range n.taints {
		var o nodecond.Taint
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
