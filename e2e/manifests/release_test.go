package manifests

import (
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"sigs.k8s.io/yaml"

	"multireg.dev/multireg/e2e/manifests/valuesdoc"
)

// makeVar returns the value of a `NAME :=` line of the Makefile.
func makeVar(t *testing.T, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + `\s*:?=\s*(\S+)\s*$`).FindStringSubmatch(string(readRepoFile(t, "Makefile")))
	if m == nil {
		t.Fatalf("the Makefile sets no %s", name)
	}
	return m[1]
}

// TestOneVersion: the VERSION file names the release the tree is or leads to. Until its
// commit the chart is a development chart, VERSION without the v and with -dev, and the
// CHANGELOG's newest section is "Unreleased" (none for VERSION yet: it is not released); on
// the release's commit the chart says VERSION and the newest section is VERSION's. appVersion,
// the chart's Artifact Hub image and the examples' image tag are the chart's version with the
// v, and every default image is in the repository the release workflow publishes to.
func TestOneVersion(t *testing.T) {
	version := strings.TrimSpace(string(readRepoFile(t, "VERSION")))
	if !regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`).MatchString(version) {
		t.Fatalf("VERSION %q is not a semantic version with a leading v", version)
	}
	c := loadChart(t)
	release := strings.TrimPrefix(version, "v")
	released := c.Metadata.Version == release
	if !released && c.Metadata.Version != release+"-dev" {
		t.Errorf("Chart.yaml version %q; want %q (VERSION without the v; -dev until the release's commit) or %q (on it)", c.Metadata.Version, release+"-dev", release)
	}
	appVersion := "v" + c.Metadata.Version
	if c.Metadata.AppVersion != appVersion {
		t.Errorf("Chart.yaml appVersion %q; want the chart's version with the v, %q", c.Metadata.AppVersion, appVersion)
	}
	repo := makeVar(t, "IMAGE_REPO")
	var images []struct{ Name, Image string }
	if err := yaml.Unmarshal([]byte(c.Metadata.Annotations["artifacthub.io/images"]), &images); err != nil {
		t.Fatal(err)
	}
	if len(images) != 1 || images[0].Image != repo+":"+appVersion {
		t.Errorf("artifacthub.io/images %+v; want %s:%s", images, repo, appVersion)
	}
	if got := c.Values["image"].(map[string]any)["repository"]; got != repo {
		t.Errorf("values.yaml image.repository %q; want the release's %q (the Makefile's IMAGE_REPO)", got, repo)
	}
	kust := string(readRepoFile(t, "examples/kustomization.yaml"))
	if !strings.Contains(kust, "newName: "+repo+"\n") || !strings.Contains(kust, "newTag: "+appVersion+"\n") {
		t.Errorf("examples/kustomization.yaml: want images newName: %s, newTag: %s", repo, appVersion)
	}
	if ds := string(readRepoFile(t, "examples/daemonset.yaml")); !strings.Contains(ds, "image: "+repo+":"+appVersion) {
		t.Errorf("examples/daemonset.yaml: want image %s:%s", repo, appVersion)
	}

	changelog := string(readRepoFile(t, "CHANGELOG.md"))
	var sections []string
	for _, m := range regexp.MustCompile(`(?m)^## \[?([^\]\s]+)\]?`).FindAllStringSubmatch(changelog, -1) {
		sections = append(sections, m[1])
	}
	switch {
	case len(sections) == 0:
		t.Error("CHANGELOG.md has no section")
	case released && sections[0] != version:
		t.Errorf("CHANGELOG.md's sections %v; the chart is the release's, %s: want its section first", sections, version)
	case !released && sections[0] != "Unreleased":
		t.Errorf("CHANGELOG.md's sections %v; the chart is a development chart: want Unreleased first", sections)
	case !released && slices.Contains(sections, version):
		t.Errorf("CHANGELOG.md has a section %s, but the chart is a development chart (%s): a release's section comes with its commit", version, c.Metadata.Version)
	}
	// The chart's changes are checked against this section: TestChartChanges.
	// The release workflow pushes to the same repository and checks the tag against VERSION.
	wf := string(readRepoFile(t, ".github/workflows/release.yaml"))
	for _, want := range []string{"make -s image-repo", "$(cat VERSION)", "make -s image-push", "make image sbom chart release-notes", ".ci/run", "RELEASE: \"1\""} {
		if !strings.Contains(wf, want) {
			t.Errorf("the release workflow does not run %q", want)
		}
	}
}

// changelogItem is one bullet of a CHANGELOG.md section, under its "### " heading.
type changelogItem struct {
	kind string // the heading's first word, lower case: fixed, added, changed, security, …
	text string // the bullet, its lines joined
}

// newestChangelogSection returns the name of CHANGELOG.md's first "## " section (Unreleased, or
// the release's version on its commit) and its bullets.
func newestChangelogSection(changelog string) (name string, items []changelogItem) {
	kind := ""
	in := false
	for _, line := range strings.Split(changelog, "\n") {
		switch {
		case strings.HasPrefix(line, "## "):
			if in {
				return name, items
			}
			in, name = true, strings.Trim(strings.TrimSpace(strings.TrimPrefix(line, "## ")), "[]")
		case !in:
		case strings.HasPrefix(line, "### "):
			kind = strings.ToLower(strings.Fields(strings.TrimPrefix(line, "### "))[0])
		case strings.HasPrefix(line, "- "):
			items = append(items, changelogItem{kind: kind, text: strings.TrimPrefix(line, "- ")})
		case strings.HasPrefix(line, "  ") && len(items) > 0 && strings.TrimSpace(line) != "":
			items[len(items)-1].text += " " + strings.TrimSpace(line)
		}
	}
	return name, items
}

// beforeUpgrading returns what an item's "**Before upgrading**" is about: the code spans of its
// bold lead and of the sentence that begins with "**Before upgrading**"; ok is false when the
// item has none.
func beforeUpgrading(text string) (terms []string, ok bool) {
	i := strings.Index(text, "**Before upgrading**")
	if i < 0 {
		return nil, false
	}
	sentence := text[i:]
	if j := strings.Index(sentence, ". "); j >= 0 {
		sentence = sentence[:j]
	}
	lead := ""
	if strings.HasPrefix(text, "**") {
		if j := strings.Index(text[2:], "**"); j >= 0 {
			lead = text[2 : 2+j]
		}
	}
	for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(lead+" "+sentence, -1) {
		terms = append(terms, m[1])
	}
	return terms, true
}

// TestChartChanges: the chart's artifacthub.io/changes are the CHANGELOG's section of this
// release (Unreleased until the release's commit): each entry of a kind the section has (its
// "### " headings: Fixed, Added, Changed, Security, …), every "**Before upgrading**" item of the
// section an entry of its own kind that says "Before upgrading" and names what the item names,
// and containsSecurityUpdates true only for a release whose section has security fixes.
func TestChartChanges(t *testing.T) {
	annotations := loadChart(t).Metadata.Annotations
	name, items := newestChangelogSection(string(readRepoFile(t, "CHANGELOG.md")))
	if len(items) == 0 {
		t.Fatalf("CHANGELOG.md's section %q has no item", name)
	}
	kinds := map[string]bool{}
	for _, it := range items {
		kinds[it.kind] = true
	}

	var changes []struct{ Kind, Description string }
	if err := yaml.Unmarshal([]byte(annotations["artifacthub.io/changes"]), &changes); err != nil || len(changes) == 0 {
		t.Fatalf("artifacthub.io/changes: %d changes (%v); want this release's", len(changes), err)
	}
	for _, ch := range changes {
		if !regexp.MustCompile(`^(added|changed|deprecated|removed|fixed|security)$`).MatchString(ch.Kind) || ch.Description == "" {
			t.Errorf("artifacthub.io/changes: %+v: want a kind Artifact Hub knows and a description", ch)
		}
		if !kinds[ch.Kind] {
			t.Errorf("artifacthub.io/changes: an entry of kind %q, but CHANGELOG.md's section %s has no such heading (its kinds: %v): %s",
				ch.Kind, name, slices.Sorted(maps.Keys(kinds)), ch.Description)
		}
	}

	used := make([]bool, len(changes))
	for _, it := range items {
		terms, ok := beforeUpgrading(it.text)
		if !ok {
			continue
		}
		found := false
		for i, ch := range changes {
			if used[i] || ch.Kind != it.kind || !strings.Contains(strings.ToLower(ch.Description), "before upgrading") {
				continue
			}
			if slices.ContainsFunc(terms, func(term string) bool { return strings.Contains(ch.Description, term) }) {
				used[i], found = true, true
				break
			}
		}
		if !found {
			t.Errorf("CHANGELOG.md's section %s says **Before upgrading** in a %q item, and artifacthub.io/changes has no entry of that kind that says \"Before upgrading\" and names one of %q:\n%.300s",
				name, it.kind, terms, it.text)
		}
	}

	switch security := annotations["artifacthub.io/containsSecurityUpdates"]; security {
	case "", "false":
	case "true":
		if !kinds["security"] {
			t.Errorf("artifacthub.io/containsSecurityUpdates is true, but CHANGELOG.md's section %s has no Security heading: Artifact Hub tells the users of earlier releases that this one fixes security issues of theirs", name)
		}
	default:
		t.Errorf("artifacthub.io/containsSecurityUpdates %q; want \"true\" or \"false\"", security)
	}
}

// TestChartMetadata: what Artifact Hub and helm show of the chart.
func TestChartMetadata(t *testing.T) {
	m := loadChart(t).Metadata
	if m.KubeVersion != ">=1.33.0-0" {
		t.Errorf("kubeVersion %q; want >=1.33.0-0 (kubelet 1.33 to 1.37)", m.KubeVersion)
	}
	if m.Home == "" || len(m.Sources) == 0 || len(m.Maintainers) == 0 {
		t.Errorf("home %q, sources %q, maintainers %v: want each", m.Home, m.Sources, m.Maintainers)
	}
	if m.Annotations["artifacthub.io/license"] != "Apache-2.0" {
		t.Errorf("artifacthub.io/license %q; want Apache-2.0", m.Annotations["artifacthub.io/license"])
	}
	if !strings.HasPrefix(string(readRepoFile(t, "LICENSE")), "\n                                 Apache License\n                           Version 2.0, January 2004\n") {
		t.Error("LICENSE is not the Apache License 2.0")
	}
}

// TestChartReadmeValues: the chart's README documents every value as values.yaml says
// (make chart-readme writes the table).
func TestChartReadmeValues(t *testing.T) {
	values, err := os.ReadFile(filepath.Join(chartDir(t), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	table, err := valuesdoc.Table(values)
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(chartDir(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	want, err := valuesdoc.Update(readme, table)
	if err != nil {
		t.Fatal(err)
	}
	if string(want) != string(readme) {
		t.Error("charts/multireg/README.md's values table is not values.yaml's: run make chart-readme")
	}
	for _, key := range []string{"image.digest", "serviceAccount.create", "serviceAccount.name", "env", "kubeletDir", "drivers"} {
		if !strings.Contains(table, "| `"+key+"` |") {
			t.Errorf("the values table has no row for %s", key)
		}
	}
	for _, want := range []string{"pod-security.kubernetes.io/enforce=privileged", "add-scc-to-user", "helm install"} {
		if !strings.Contains(string(readme), want) {
			t.Errorf("the chart's README does not say %q", want)
		}
	}
}

// renderDeployment renders the chart with values (YAML) and returns the deployment and the
// objects.
func renderDeployment(t *testing.T, values string) (*deployment, manifests) {
	t.Helper()
	var v map[string]any
	if err := yaml.Unmarshal([]byte(values), &v); err != nil {
		t.Fatal(err)
	}
	return renderChartDeployment(t, loadChart(t), v)
}

// renderChartDeployment renders chart c with values and returns the deployment and the objects.
func renderChartDeployment(t testing.TB, c *chart.Chart, values map[string]any) (*deployment, manifests) {
	t.Helper()
	out, err := renderChart(c, values)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeManifests([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	d, err := deploymentOf(m)
	if err != nil {
		t.Fatal(err)
	}
	return d, m
}

// TestChartImage: the DaemonSet and the helm test pod pull one image, by digest when one is set.
func TestChartImage(t *testing.T) {
	digest := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	tests := []struct {
		name, values, want string
	}{
		{"default", "", "ghcr.io/multireg/multireg:" + loadChart(t).Metadata.AppVersion},
		{"tag", "image: {tag: v9.9.9}", "ghcr.io/multireg/multireg:v9.9.9"},
		{"digest", "image: {repository: registry.test/mr, digest: " + digest + "}", "registry.test/mr@" + digest},
		{"digest wins over the tag", "image: {tag: v9.9.9, digest: " + digest + "}", "ghcr.io/multireg/multireg@" + digest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, _ := renderDeployment(t, tt.values)
			if d.container.Image != tt.want {
				t.Errorf("image %q; want %q", d.container.Image, tt.want)
			}
			// helm test runs the very image the DaemonSet runs, pulled the same way.
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tt.values), &values); err != nil {
				t.Fatal(err)
			}
			if pod := renderTestPod(t, loadChart(t), values); pod.Spec.Containers[0].Image != tt.want {
				t.Errorf("the helm test pod's image %q; want the DaemonSet's, %q", pod.Spec.Containers[0].Image, tt.want)
			}
		})
	}
	checkRenders(t, loadChart(t), []renderCase{
		{"digest without its algorithm", "image: {digest: " + strings.Repeat("0123456789abcdef", 4) + "}", "at '/image/digest'"},
		{"digest too short", "image: {digest: sha256:0123}", "at '/image/digest'"},
		{"a tag in the digest", "image: {digest: 'v0.1.0@" + digest + "'}", "at '/image/digest'"},
	})
}

func TestChartServiceAccount(t *testing.T) {
	tests := []struct {
		name, values string
		wantSA       string // the pods' service account
		created      bool
	}{
		{"created by default", "", "multireg", true},
		{"created under a name", "serviceAccount: {name: registrar}", "registrar", true},
		{"an existing one", "serviceAccount: {create: false, name: node-agents}", "node-agents", false},
		{"the namespace's default", "serviceAccount: {create: false}", "default", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, m := renderDeployment(t, tt.values)
			spec := d.ds.Spec.Template.Spec
			if spec.ServiceAccountName != tt.wantSA {
				t.Errorf("serviceAccountName %q; want %q", spec.ServiceAccountName, tt.wantSA)
			}
			// The node condition, on by default, needs the token (TestChartNodeCondition: and
			// only it).
			if spec.AutomountServiceAccountToken == nil || !*spec.AutomountServiceAccountToken {
				t.Error("the pods do not mount their service account token; the node condition needs it")
			}
			if !tt.created {
				if len(m.serviceAccounts) != 0 {
					t.Errorf("%d service accounts rendered; want none", len(m.serviceAccounts))
				}
				return
			}
			if len(m.serviceAccounts) != 1 {
				t.Fatalf("%d service accounts rendered; want 1", len(m.serviceAccounts))
			}
			sa := m.serviceAccounts[0]
			if sa.Name != tt.wantSA || sa.Namespace != releaseNamespace {
				t.Errorf("service account %s/%s; want %s/%s", sa.Namespace, sa.Name, releaseNamespace, tt.wantSA)
			}
			if sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
				t.Error("the service account automounts its token")
			}
			if sa.Labels["app.kubernetes.io/instance"] != releaseName {
				t.Errorf("service account labels %v; want the chart's", sa.Labels)
			}
		})
	}
	checkRenders(t, loadChart(t), []renderCase{
		{"misspelt create", "serviceAccount: {created: true}", "additional properties 'created' not allowed"},
		{"annotations not strings", "serviceAccount: {annotations: {a: 1}}", "at '/serviceAccount/annotations/a'"},
	})
}

func TestChartEnv(t *testing.T) {
	for _, tt := range []struct {
		values string
		first  string // the chart's own variable before the values' env; "" for none
	}{
		{"", "NODE_NAME"}, // the node condition's --node-name
		{"nodeCondition: {enabled: false}\n", ""},
	} {
		d, _ := renderDeployment(t, tt.values+"env: [{name: GOMEMLIMIT, value: 100MiB}, {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}]")
		env := d.container.Env
		if tt.first != "" {
			if len(env) == 0 || env[0].Name != tt.first {
				t.Fatalf("%q: env %+v; want %s first", tt.values, env, tt.first)
			}
			env = env[1:]
		}
		if len(env) != 2 || env[0].Name != "GOMEMLIMIT" || env[0].Value != "100MiB" ||
			env[1].ValueFrom == nil || env[1].ValueFrom.FieldRef == nil || env[1].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
			t.Errorf("%q: env %+v; want GOMEMLIMIT=100MiB and NODE from the node's name", tt.values, env)
		}
	}
	if d, _ := renderDeployment(t, "nodeCondition: {enabled: false}"); d.container.Env != nil {
		t.Errorf("env %+v without the node condition; want none", d.container.Env)
	}
	checkRenders(t, loadChart(t), []renderCase{
		{"env without a name", "env: [{value: x}]", "missing property 'name'"},
		{"env as a map", "env: {GOMEMLIMIT: 100MiB}", "at '/env'"},
	})
}
