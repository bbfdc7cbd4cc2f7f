package config

import (
	"strings"
	"testing"
)

func TestParseDeviceMoves(t *testing.T) {
	for give, want := range map[string]DeviceMoves{"": MovesAuto, "auto": MovesAuto, "beside": MovesBeside, "after": MovesAfter} {
		if got, err := ParseDeviceMoves(give); err != nil || got != want {
			t.Errorf("ParseDeviceMoves(%q) = %q, %v; want %q", give, got, err, want)
		}
	}
	if _, err := ParseDeviceMoves("always"); err == nil || !strings.Contains(err.Error(), `"always"`) {
		t.Errorf("ParseDeviceMoves(always): %v, want an error naming the value", err)
	}
}
