package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"k8s.io/apimachinery/pkg/util/duration"

	"multireg.dev/multireg/config"
)

// Roles of a multireg process, as /status, /readyz and the logs tell them. A process serves
// the registration directory only while it holds its lock; a rolling update's new pod is a
// standby until the old one hands the directory over or exits, and the old one is idle after
// it handed over.
const (
	// roleStarting: taking the directory, or asking its holder to hand it over.
	roleStarting = "starting"
	// roleServing: this process holds the directory and runs every driver's loop.
	roleServing = "serving"
	// roleStandby: another process holds the directory; this one waits for it to exit. It
	// counts as ready, so that a DaemonSet's surge rollout proceeds and removes the old pod.
	roleStandby = "standby"
	// roleIdle: this process handed the directory over; it serves nothing, touches no file
	// and exits on SIGTERM. Should its successor end without a clean shutdown, it takes the
	// directory back with the sockets it handed over, while they are still the files at their
	// paths.
	roleIdle = "idle"
)

// The phases status.go names, registrar's, which it cannot import: the registrar is
// Linux's, and `multireg status` runs anywhere (against a port-forward, say).
const (
	phaseRegistered         = "Registered"
	phaseWaitingForEndpoint = "WaitingForEndpoint"
)

// statusDoc is the JSON document of GET /status and `multireg status -o json`.
type statusDoc struct {
	Instance instanceStatus `json:"instance"`
	Config   configStatus   `json:"config"`
	// Descriptors: the registration sockets' file descriptors against RLIMIT_NOFILE; absent
	// from an instance that does not serve the directory.
	Descriptors *descriptorsStatus `json:"descriptors,omitempty"`
	// PodResources: kubelet's pod-resources API as the instance reads it; absent when it reads
	// none (--pod-resources-socket empty) or does not serve the directory.
	PodResources *podResourcesStatus `json:"podResources,omitempty"`
	// NodeCondition: the node condition the instance keeps on its Node; absent when it keeps
	// none (no --node-condition) or does not serve the directory.
	NodeCondition *nodeConditionStatus `json:"nodeCondition,omitempty"`
	Drivers       []driverStatus       `json:"drivers"`
}

// nodeConditionStatus is nodecond.Status: the condition as decided, as the node shows it, and
// how its writes went.
type nodeConditionStatus struct {
	// Agent: the process that speaks to the Kubernetes API for multireg.
	Agent agentStatus `json:"agent"`
	Type  string      `json:"type"`
	Node  string      `json:"node"`
	// Status, Reason and Message: the condition as the drivers, CSINode and pod-resources
	// decide it now.
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
	// OnNode: the condition as the Node shows it (absent: none, or the Node not read);
	// Synced: it says what Status, Reason and Message say.
	OnNode *onNodeStatus `json:"onNode,omitempty"`
	Synced bool          `json:"synced"`
	// NodeRead: the Node was read; NodeExists: there is one of that name.
	NodeRead   bool `json:"nodeRead"`
	NodeExists bool `json:"nodeExists"`
	// CSINodeRead: the node's CSINode was read (it may not exist yet).
	CSINodeRead bool       `json:"csiNodeRead"`
	Writes      int        `json:"writes"`
	WriteErrors int        `json:"writeErrors"`
	LastWrite   *time.Time `json:"lastWrite"`
	LastError   string     `json:"lastError"`
	// StartupTaint: the taint removed the first time the condition is True (absent: none).
	StartupTaint *startupTaintStatus `json:"startupTaint,omitempty"`
}

// agentStatus is relay.Agent: whether the node condition's agent runs, how many were started,
// and how the last one ended.
type agentStatus struct {
	Running  bool   `json:"running"`
	Starts   int    `json:"starts"`
	LastExit string `json:"lastExit,omitempty"`
}

type onNodeStatus struct {
	Status             string     `json:"status"`
	Reason             string     `json:"reason"`
	Message            string     `json:"message"`
	LastTransitionTime *time.Time `json:"lastTransitionTime"`
}

type startupTaintStatus struct {
	Taint string `json:"taint"`
	// Removed: when this process removed it; Done: it no longer looks after it (removed, or
	// absent when the condition was first True).
	Removed *time.Time `json:"removed"`
	Done    bool       `json:"done"`
}

// podResourcesStatus is registrar.PodResources.
type podResourcesStatus struct {
	Socket  string `json:"socket"`
	Answers bool   `json:"answers"`
	// DevicePluginMoves: how a device plugin's new instance is registered now, "beside" the
	// running one or "in place" of its registration.
	DevicePluginMoves string `json:"devicePluginMoves"`
}

// descriptorsStatus is registrar.Descriptors: whether the drivers' sockets fit in the
// descriptors RLIMIT_NOFILE leaves them, and if not, what does not.
type descriptorsStatus struct {
	Limit       int    `json:"limit"`
	Reserved    int    `json:"reserved"`
	MaxSockets  int    `json:"maxSockets"`
	Needed      int    `json:"needed"`
	Sockets     int    `json:"sockets"`
	Connections int    `json:"connections"`
	Fits        bool   `json:"fits"`
	Problem     string `json:"problem"`
}

// instanceStatus is the process's role (instance.go).
type instanceStatus struct {
	Role   string     `json:"role"`
	Since  *time.Time `json:"since"`
	Detail string     `json:"detail"`
	// TakenOver counts the registration sockets the previous instance handed over, which
	// this one serves (role serving).
	TakenOver int `json:"inherited"` // the key v0.1.0's /status has
}

type configStatus struct {
	Path                 string     `json:"path"`
	Generation           int        `json:"generation"`
	LastReloadSuccessful bool       `json:"lastReloadSuccessful"`
	LastReloadError      string     `json:"lastReloadError"`
	LastReloadTime       *time.Time `json:"lastReloadTime"`
}

type driverStatus struct {
	Name string `json:"name"`
	Type string `json:"type"`
	// What the drivers file says of the driver for status to show (config.Display), each
	// field under its own json tag.
	config.Display
	Phase       string `json:"phase"`
	Socket      string `json:"socket"`
	Endpoint    string `json:"endpoint"`
	EndpointUp  bool   `json:"endpointUp"`
	Absent      bool   `json:"absent"`
	Required    bool   `json:"required"`
	HeldByOther bool   `json:"heldByOther"`
	// InTheWay: registration paths of the driver's that something else is in, which the
	// loop registers around.
	InTheWay    []string   `json:"inTheWay,omitempty"`
	Attempts    int        `json:"attempts"`
	Failures    int        `json:"failures"`
	LastError   string     `json:"lastError"`
	Since       *time.Time `json:"since"`
	NextAttempt *time.Time `json:"nextAttempt"`
	// Kubelet is kubelet's own view of a device plugin's resource (its pod-resources API);
	// absent for other types, and while that API does not answer.
	Kubelet *kubeletStatus `json:"kubelet,omitempty"`
	// CSINode: whether the node's CSINode lists a CSI driver; absent for other types, without
	// the node condition, and until the CSINode is read.
	CSINode *csiNodeStatus `json:"csiNode,omitempty"`
	// Held: whether kubelet holds the driver as its own records say, the node condition's
	// test (for every driver; only a required one decides); absent without the condition.
	Held *heldStatus `json:"held,omitempty"`
	// Liveness: the driver's last liveness check (GET /healthz/<driver>, the gRPC health
	// service); absent until one is asked for. It never changes the registration.
	Liveness *livenessStatus `json:"liveness,omitempty"`
}

// livenessStatus is a driver's last liveness check: when, how long it took, and whether the
// driver was alive (else why not).
type livenessStatus struct {
	At     *time.Time `json:"at"`
	TookMs float64    `json:"tookMs"`
	Alive  bool       `json:"alive"`
	Error  string     `json:"error,omitempty"`
}

// csiNodeStatus is what the node's CSINode says of a CSI driver.
type csiNodeStatus struct {
	Listed bool `json:"listed"`
	// Since: since when this instance has seen it listed.
	Since *time.Time `json:"since"`
	// Missing: kubelet accepted the driver over two reconcile passes ago, and CSINode does not
	// list it.
	Missing bool `json:"missing"`
}

// heldStatus is whether kubelet holds a driver, as its own records say, and if not, why.
type heldStatus struct {
	Held bool   `json:"held"`
	Why  string `json:"why,omitempty"`
}

// kubeletStatus is what kubelet's pod-resources API says of a device plugin's resource.
type kubeletStatus struct {
	// Devices counts the allocatable devices kubelet's device manager holds for it.
	Devices int `json:"devices"`
	// ReadAt is when kubelet said so; Since, since when it has held that many.
	ReadAt *time.Time `json:"readAt"`
	Since  *time.Time `json:"since"`
	// Missing: the driver is registered and kubelet, which held devices of its resource, has
	// held none for longer than a reconcile pass.
	Missing bool `json:"missing"`
}

// statusTimeout bounds `multireg status`'s request.
const statusTimeout = 5 * time.Second

// maxStatusSize bounds the answer `multireg status` reads, so that it stays small inside the
// daemon's pod (kubectl exec, under the pod's memory limit) whatever answers: the /status of
// 1000 drivers, each waiting for its endpoint with the probe's error, is 0.62 MiB; 4 MiB holds
// about 6000 such drivers, or 1000 whose last errors are 3.5 KiB each. The answer is read into
// memory once, up to this; the document is walked as a stream, never decoded whole.
const maxStatusSize = 4 << 20

// runStatus is `multireg status`: it asks the running daemon for its state and prints it.
func runStatus(ctx context.Context, args []string, std stdio, helpOnly bool) error {
	stdout := std.out
	var addr, output string
	c := newCommand("status", "[--http-endpoint HOST:PORT|URL] [-o table|json|yaml]",
		"Print the running daemon's state: its role, its drivers file, and each driver's phase, attempts\n"+
			"and kubelet's last answer. It asks the daemon's GET /status.")
	c.footer = `Exit codes:
  0   the daemon answered (whatever its drivers' state)
  1   no answer, or not a status document
  2   a usage error`
	c.String(&addr, "http-endpoint", "HOST:PORT|URL", defaultHTTPEndpoint, "the daemon's --http-endpoint, or a URL reaching it (http://127.0.0.1:9809 through kubectl port-forward)")
	c.String(&output, "o,output", "FORMAT", "table", "output format: table, json or yaml")
	if err := parseOrHelp(c, args, stdout, helpOnly); err != nil {
		return err
	}
	if output != "table" && output != "json" && output != "yaml" {
		return c.usageError("-o %q: must be table, json or yaml", output)
	}
	target, err := statusURL(addr)
	if err != nil {
		return c.usageError("--http-endpoint %q: %v", addr, err)
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return c.usageError("--http-endpoint %q: %v", addr, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("multireg status: no answer from the daemon at %s: %v (is `multireg run` running, with the same --http-endpoint?)", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("multireg status: %s answered %s", target, resp.Status)
	}
	body, err := readStatus(resp, maxStatusSize)
	if errors.Is(err, errTooLarge) {
		return fmt.Errorf("multireg status: the answer of %s is over %d MiB, the most multireg status reads (the status of some 6000 drivers): is it multireg's --http-endpoint?", target, maxStatusSize>>20)
	}
	if err != nil {
		return fmt.Errorf("multireg status: read the answer from %s: %w", addr, err)
	}
	doc, err := decodeStatus(body, func(driverStatus) {})
	if err != nil {
		return fmt.Errorf("multireg status: %s did not answer with a status document: %w", target, err)
	}
	switch output {
	case "json":
		_, err := stdout.Write(body)
		return err
	case "yaml":
		// The daemon's document as it is, fields this version does not know included.
		return writeYAML(stdout, body)
	}
	return printStatusTable(stdout, doc, func(each func(driverStatus)) error {
		_, err := decodeStatus(body, each)
		return err
	}, time.Now())
}

// errTooLarge is readStatus's error for an answer over its bound.
var errTooLarge = errors.New("too large")

// readStatus reads the body of resp, up to limit bytes; past that it returns errTooLarge,
// without reading more (at once when the answer says its length). Its buffer grows by
// doubling up to limit+1 bytes at most.
func readStatus(resp *http.Response, limit int) ([]byte, error) {
	if resp.ContentLength > int64(limit) {
		return nil, errTooLarge
	}
	size := 64 << 10
	if resp.ContentLength >= 0 {
		size = int(resp.ContentLength) + 1 // room to see the end
	}
	b := make([]byte, 0, min(size, limit+1))
	for {
		if len(b) == cap(b) {
			if len(b) > limit {
				return nil, errTooLarge
			}
			b = append(make([]byte, 0, min(2*cap(b), limit+1)), b...)
		}
		n, err := resp.Body.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF && len(b) <= limit {
			return b, nil
		}
		if err == io.EOF {
			return nil, errTooLarge
		}
		if err != nil {
			return nil, err
		}
	}
}

// decodeStatus decodes a status document, as json.Unmarshal into a statusDoc would but for
// its drivers: it passes each to each as it decodes it, and returns the document without them.
// It holds one driver at a time: a document of a million tiny entries costs no more memory
// than one of ten.
func decodeStatus(body []byte, each func(driverStatus)) (statusDoc, error) {
	var doc statusDoc
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := expectDelim(dec, '{', "a JSON object"); err != nil {
		return doc, err
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return doc, err
		}
		var v any
		switch key, _ := tok.(string); key {
		case "instance":
			v = &doc.Instance
		case "config":
			v = &doc.Config
		case "descriptors":
			v = &doc.Descriptors
		case "podResources":
			v = &doc.PodResources
		case "nodeCondition":
			v = &doc.NodeCondition
		case "drivers":
			if err := decodeDrivers(dec, each); err != nil {
				return doc, fmt.Errorf("drivers: %w", err)
			}
			continue
		default: // a field this version does not know
			if err := skipValue(dec); err != nil {
				return doc, fmt.Errorf("%s: %w", key, err)
			}
			continue
		}
		if err := dec.Decode(v); err != nil {
			return doc, err
		}
	}
	if err := expectDelim(dec, '}', "the object's end"); err != nil {
		return doc, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return doc, fmt.Errorf("more after the document")
	}
	return doc, nil
}

// maxStatusDepth is how deep decodeStatus lets the values it does not know nest: the daemon's
// document is a few levels deep (a driver's display fields may add one), and writeYAML
// recurses once per level.
const maxStatusDepth = 32

// skipValue reads the value a decoder is at, a token at a time: it holds none of it.
func skipValue(dec *json.Decoder) error {
	depth := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			if depth++; depth > maxStatusDepth {
				return fmt.Errorf("nested deeper than %d", maxStatusDepth)
			}
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
		if depth == 0 {
			return nil
		}
	}
}

// decodeDrivers decodes the drivers array (or null) a decoder is at, one element at a time.
func decodeDrivers(dec *json.Decoder, each func(driverStatus)) error {
	tok, err := dec.Token()
	if err != nil || tok == nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return fmt.Errorf("not an array: %v", tok)
	}
	for dec.More() {
		var d driverStatus
		if err := dec.Decode(&d); err != nil {
			return err
		}
		each(d)
	}
	_, err = dec.Token()
	return err
}

// expectDelim reads the next token, which must be the delimiter want.
func expectDelim(dec *json.Decoder, want json.Delim, what string) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("want %s, got %v", what, tok)
	}
	return nil
}

// writeYAML writes a JSON document as YAML, in block style, its mappings' keys in the
// document's order. It holds one token at a time, never the document: the YAML of a
// document's every value would take many times the document's size.
func writeYAML(w io.Writer, body []byte) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	y := yamlWriter{dec: dec, w: bufio.NewWriter(w)}
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if err := y.value(tok, 0, yamlTop); err != nil {
		return err
	}
	return y.w.Flush()
}

// yamlWriter writes the tokens of a JSON decoder as YAML.
type yamlWriter struct {
	dec *json.Decoder
	w   *bufio.Writer
}

// Where a value stands: alone (the document), after "key:", or after a sequence's "-".
const (
	yamlTop = iota
	yamlAfterKey
	yamlAfterDash
)

// value writes the value that starts with tok. indent is the column of a collection's entries
// on their own lines.
func (y *yamlWriter) value(tok json.Token, indent int, at int) error {
	open, ok := tok.(json.Delim)
	if !ok {
		if at != yamlTop {
			y.w.WriteByte(' ')
		}
		y.w.WriteString(yamlScalar(tok))
		y.w.WriteByte('\n')
		return nil
	}
	if !y.dec.More() { // empty: {} or []
		if _, err := y.dec.Token(); err != nil {
			return err
		}
		if at != yamlTop {
			y.w.WriteByte(' ')
		}
		y.w.WriteString(map[json.Delim]string{'{': "{}", '[': "[]"}[open])
		y.w.WriteByte('\n')
		return nil
	}
	switch at {
	case yamlAfterKey:
		y.w.WriteByte('\n')
	case yamlAfterDash:
		y.w.WriteByte(' ')
	}
	for first := true; y.dec.More(); first = false {
		if !first || at == yamlAfterKey {
			y.w.WriteString(strings.Repeat(" ", indent))
		}
		tok, err := y.dec.Token()
		if err != nil {
			return err
		}
		entry := yamlAfterDash
		if open == '{' {
			y.w.WriteString(yamlScalar(tok))
			y.w.WriteByte(':')
			entry = yamlAfterKey
			if tok, err = y.dec.Token(); err != nil {
				return err
			}
		} else {
			y.w.WriteByte('-')
		}
		if err := y.value(tok, indent+2, entry); err != nil {
			return err
		}
	}
	_, err := y.dec.Token() // the closing delimiter
	return err
}

// yamlScalar renders a JSON scalar (with json.Number for numbers) as a YAML one that reads
// back as the same value: a string plain when it is words and paths that YAML reads as a
// string, double-quoted otherwise.
func yamlScalar(tok json.Token) string {
	switch v := tok.(type) {
	case nil:
		return "null"
	case bool:
		return strconv.FormatBool(v)
	case json.Number:
		return v.String()
	case string:
		if yamlPlain(v) {
			return v
		}
		return yamlQuoted(v)
	}
	return fmt.Sprint(tok)
}

// yamlPlain reports whether s reads back as the string s when written plain: letters,
// digits, spaces and . _ / -, starting with a letter or /, not ending with a space, and none
// of the words YAML 1.1 reads as a boolean or null.
func yamlPlain(s string) bool {
	if s == "" || !(s[0] == '/' || 'a' <= s[0]|0x20 && s[0]|0x20 <= 'z') || s[len(s)-1] == ' ' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c|0x20 && c|0x20 <= 'z' || '0' <= c && c <= '9' || strings.IndexByte(" ._/-", c) >= 0) {
			return false
		}
	}
	switch strings.ToLower(s) {
	case "y", "n", "yes", "no", "on", "off", "true", "false", "null":
		return false
	}
	return true
}

// yamlQuoted is s as a YAML double-quoted scalar, on one line: what is not printable in YAML
// (control characters, DEL, C1 controls, the BOM, non-characters) escaped.
func yamlQuoted(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || 0x7f <= r && r < 0xa0 || 0xd800 <= r && r < 0xe000 || r == 0xfeff || r == 0xfffe || r == 0xffff:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// statusURL is the URL of the daemon's /status: from its --http-endpoint (host:port, as run
// takes it), or from a URL reaching it (http://host:port, a path prefix of a proxy kept).
func statusURL(addr string) (string, error) {
	if strings.Contains(addr, "://") {
		u, err := url.Parse(addr)
		if err != nil {
			return "", err
		}
		if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
			return "", fmt.Errorf("a URL must be http:// or https:// with a host")
		}
		if u.RawQuery != "" || u.Fragment != "" {
			return "", fmt.Errorf("a URL must have no query or fragment")
		}
		u.Path = strings.TrimSuffix(u.Path, "/") + "/status"
		return u.String(), nil
	}
	if addr == "" {
		return "", fmt.Errorf("empty: the daemon serves no HTTP without one")
	}
	if err := checkListenAddr(addr); err != nil {
		return "", err
	}
	return "http://" + dialAddress(addr) + "/status", nil
}

// dialAddress turns a listen address (":9809", "0.0.0.0:9809") into one to dial.
func dialAddress(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

// statusColumns are the table's columns.
var statusColumns = [...]string{"DRIVER", "TYPE", "PHASE", "SINCE", "ATTEMPTS", "FAILURES", "NEXT RETRY", "KUBELET", "LAST ERROR"}

// kubeletColumn is KUBELET, what kubelet's pod-resources API says of a device plugin's
// resource: printed only where it says something of a driver.
const kubeletColumn = 7

// printStatusTable prints the document as a table a person reads at a glance, its drivers
// from drivers, which it walks
// twice: for the counts and the columns' widths, then to print each row. It holds one row at
// a time.
func printStatusTable(w io.Writer, doc statusDoc, drivers func(each func(driverStatus)) error, now time.Time) error {
	if in := doc.Instance; in.Role != "" && in.Role != roleServing {
		since := ""
		if in.Since != nil {
			since = " for " + age(now.Sub(*in.Since))
		}
		fmt.Fprintf(w, "instance %s%s: %s\n", in.Role, since, in.Detail)
		return nil
	}
	var widths [len(statusColumns)]int
	measure := func(row [len(statusColumns)]string) {
		for i, cell := range row {
			widths[i] = max(widths[i], utf8.RuneCountInString(cell))
		}
	}
	measure(statusColumns)
	total, registered, absent := 0, 0, 0
	kubeletCol := false
	err := drivers(func(d driverStatus) {
		total++
		kubeletCol = kubeletCol || d.Kubelet != nil || d.CSINode != nil
		switch {
		case d.Phase == phaseRegistered:
			registered++
		case d.Absent:
			absent++
		}
		measure(statusRow(d, now))
	})
	if err != nil {
		return err
	}
	if doc.Instance.TakenOver > 0 {
		fmt.Fprintf(w, "instance serving: %s, %d sockets taken over\n", doc.Instance.Detail, doc.Instance.TakenOver)
	}
	c := doc.Config
	state := "applied"
	if !c.LastReloadSuccessful {
		state = "NOT APPLIED: " + c.LastReloadError
	}
	fmt.Fprintf(w, "config %s (generation %d): %s\n", c.Path, c.Generation, strings.ReplaceAll(state, "\n", "; "))
	if d := doc.Descriptors; d != nil && !d.Fits {
		fmt.Fprintf(w, "NOT ENOUGH %s\n", d.Problem)
	}
	if p := doc.PodResources; p != nil {
		state := "answers"
		if !p.Answers {
			state = "DOES NOT ANSWER: no device plugin's resource is shown, no move verified"
		}
		fmt.Fprintf(w, "kubelet's pod-resources API %s: %s; device-plugin moves: %s\n", p.Socket, state, p.DevicePluginMoves)
	}
	if c := doc.NodeCondition; c != nil {
		fmt.Fprintf(w, "node condition %s on node %s: %s", c.Type, c.Node, conditionLine(c.Status, c.Reason, c.Message))
		switch {
		case c.Synced:
		case c.OnNode != nil:
			fmt.Fprintf(w, "; NOT ON THE NODE YET, which shows %s", conditionLine(c.OnNode.Status, c.OnNode.Reason, c.OnNode.Message))
		default:
			fmt.Fprint(w, "; NOT ON THE NODE YET")
		}
		if c.LastError != "" && !c.Synced {
			fmt.Fprintf(w, " (%s)", c.LastError)
		}
		if t := c.StartupTaint; t != nil {
			switch {
			case t.Removed != nil:
				fmt.Fprintf(w, "; startup taint %s removed %s ago", t.Taint, age(now.Sub(*t.Removed)))
			case t.Done:
				fmt.Fprintf(w, "; startup taint %s: not on the node", t.Taint)
			default:
				fmt.Fprintf(w, "; startup taint %s: removed once the condition is True", t.Taint)
			}
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "%d of %d drivers registered", registered, total)
	if absent > 0 {
		fmt.Fprintf(w, ", %d absent from this node", absent)
	}
	fmt.Fprint(w, "\n\n")
	bw := bufio.NewWriter(w)
	line := func(row [len(statusColumns)]string) {
		for i, cell := range row {
			if i == kubeletColumn && !kubeletCol {
				continue
			}
			bw.WriteString(cell)
			if i < len(row)-1 { // padded as text/tabwriter pads: 2 spaces past the widest cell
				bw.WriteString(strings.Repeat(" ", widths[i]-utf8.RuneCountInString(cell)+2))
			}
		}
		bw.WriteByte('\n')
	}
	line(statusColumns)
	err = drivers(func(d driverStatus) { line(statusRow(d, now)) })
	if ferr := bw.Flush(); err == nil {
		err = ferr
	}
	return err
}

// conditionLine is a condition's value as the table says it: True, or False and why.
func conditionLine(status, reason, message string) string {
	if status == "True" {
		return "True (" + reason + ")"
	}
	return status + " (" + reason + ": " + strings.ReplaceAll(message, "\n", " ") + ")"
}

// statusRow is a driver's row of the table.
func statusRow(d driverStatus, now time.Time) [len(statusColumns)]string {
	since, next := "-", "-"
	if d.Since != nil {
		since = age(now.Sub(*d.Since))
	}
	if d.NextAttempt != nil {
		next = "in " + age(d.NextAttempt.Sub(now))
	}
	phase, lastErr := d.Phase, d.LastError
	switch {
	case !d.EndpointUp && d.Phase == phaseRegistered:
		lastErr = strings.TrimSuffix("endpoint down; "+lastErr, "; ")
	case d.Absent && d.Phase == phaseWaitingForEndpoint:
		// Not on this node: the probe's error would only say so again.
		phase, lastErr = "Absent", ""
		if d.Required {
			lastErr = "required on every node: not ready"
		}
	case d.Absent:
		// Published all the same (waitForEndpoint: false): kubelet's answer is the news,
		// as in the JSON document.
		lastErr = strings.TrimSuffix("endpoint absent from this node; "+lastErr, "; ")
	}
	if len(d.InTheWay) > 0 {
		lastErr = strings.TrimPrefix(lastErr+"; in the way: "+strings.Join(d.InTheWay, ", "), "; ")
	}
	kubelet := "-"
	if c := d.CSINode; c != nil {
		switch {
		case c.Listed:
			kubelet = "in CSINode"
		case c.Missing:
			kubelet = "NOT IN CSINODE"
			lastErr = strings.TrimPrefix(lastErr+"; kubelet accepted the driver and the node's CSINode does not list it", "; ")
		default:
			kubelet = "not in CSINode"
		}
	}
	if k := d.Kubelet; k != nil {
		kubelet = fmt.Sprintf("%d devices", k.Devices)
		if k.Missing && k.ReadAt != nil && k.Since != nil {
			kubelet = "NONE for " + age(k.ReadAt.Sub(*k.Since))
			lastErr = strings.TrimPrefix(lastErr+"; kubelet holds no device of the registered resource", "; ")
		}
	}
	if lastErr == "" {
		lastErr = "-"
	}
	return [...]string{d.Name, d.Type, phase, since, strconv.Itoa(d.Attempts), strconv.Itoa(d.Failures), next, kubelet, lastErr}
}

// age renders a duration as kubectl renders ages (3s, 90s, 4m12s, 2h5m, 3d4h); a moment
// already past reads 0s.
func age(d time.Duration) string {
	return duration.HumanDuration(max(d, 0))
}
