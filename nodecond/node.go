package nodecond

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

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
