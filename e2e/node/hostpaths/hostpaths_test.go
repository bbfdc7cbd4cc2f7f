package hostpaths

import "testing"

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{
		`/tmp/a`:                `/tmp/a`,
		`/tmp/with\040space`:    `/tmp/with space`,
		`/tmp/tab\011and\134bs`: "/tmp/tab\tand\\bs",
	} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}
