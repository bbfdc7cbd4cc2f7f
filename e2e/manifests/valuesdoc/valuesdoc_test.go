package valuesdoc

import (
	"strings"
	"testing"
)

func TestTable(t *testing.T) {
	give := `# A section's comment, before a blank line.

# The kubelet's <root>.
# On two lines.
kubeletDir: /var/lib/kubelet
drivers: []
# drivers:
#   - name: x

# Pass-through: one row.
resources:
  limits:
    memory: 128Mi
image:
  # Where | from.
  repository: ghcr.io/x
  tag: ""
httpPort: 9809
enabled: false
`
	got, err := Table([]byte(give))
	if err != nil {
		t.Fatal(err)
	}
	want := "| Key | Type | Default | Description |\n|---|---|---|---|\n" +
		"| `kubeletDir` | string | `\"/var/lib/kubelet\"` | The kubelet's &lt;root&gt;. On two lines. |\n" +
		"| `drivers` | list | `[]` |  |\n" +
		"| `resources` | object | `{\"limits\":{\"memory\":\"128Mi\"}}` | Pass-through: one row. |\n" +
		"| `image.repository` | string | `\"ghcr.io/x\"` | Where \\| from. |\n" +
		"| `image.tag` | string | `\"\"` |  |\n" +
		"| `httpPort` | int | `9809` |  |\n" +
		"| `enabled` | bool | `false` |  |\n"
	if got != want {
		t.Errorf("Table:\n%s\nwant:\n%s", got, want)
	}
}

func TestUpdate(t *testing.T) {
	readme := "# Chart\n\n" + Begin + "\nold\n" + End + "\nafter\n"
	got, err := Update([]byte(readme), "new\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := "# Chart\n\n" + Begin + "\nnew\n" + End + "\nafter\n"; string(got) != want {
		t.Errorf("Update = %q; want %q", got, want)
	}
	if _, err := Update([]byte("# no markers\n"), "x"); err == nil || !strings.Contains(err.Error(), "values-table") {
		t.Errorf("Update without markers: %v", err)
	}
}
