package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/duration"
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
	Drivers     []driverStatus     `json:"drivers"`
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
	// Inherited counts the registration sockets the previous instance handed over, which
	// this one serves (role serving).
	Inherited int `json:"inherited"`
}

type configStatus struct {
	Path                 string     `json:"path"`
	Generation           int        `json:"generation"`
	LastReloadSuccessful bool       `json:"lastReloadSuccessful"`
	LastReloadError      string     `json:"lastReloadError"`
	LastReloadTime       *time.Time `json:"lastReloadTime"`
}

type driverStatus struct {
	Name        string     `json:"name"`
	Type        string     `json:"type"`
	Phase       string     `json:"phase"`
	Socket      string     `json:"socket"`
	Endpoint    string     `json:"endpoint"`
	EndpointUp  bool       `json:"endpointUp"`
	Absent      bool       `json:"absent"`
	Required    bool       `json:"required"`
	HeldByOther bool       `json:"heldByOther"`
	Attempts    int        `json:"attempts"`
	Failures    int        `json:"failures"`
	LastError   string     `json:"lastError"`
	Since       *time.Time `json:"since"`
	NextAttempt *time.Time `json:"nextAttempt"`
	// Kubelet is kubelet's own view of a device plugin's resource (its pod-resources API);
	// absent for other types, and while that API does not answer.
	Kubelet *kubeletStatus `json:"kubelet,omitempty"`
}

// kubeletStatus is what kubelet's pod-resources API says of a device plugin's resource.
type kubeletStatus struct {
	// Devices counts the allocatable devices kubelet's device manager holds for it.
	Devices int `json:"devices"`
	// ReadAt is when kubelet said so; Since, since when it has held that many.
	ReadAt *time.Time `json:"readAt"`
	Since  *time.Time `json:"since"`
	// Missing: the driver is registered and kubelet has held none of its devices for longer
	// than a reconcile pass.
	Missing bool `json:"missing"`
}

// statusTimeout bounds `multireg status`'s request.
const statusTimeout = 5 * time.Second

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
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("multireg status: read the answer from %s: %w", addr, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("multireg status: %s answered %s", target, resp.Status)
	}
	var doc statusDoc
	if err := json.Unmarshal(body, &doc); err != nil {
		return fmt.Errorf("multireg status: %s did not answer with a status document: %w", target, err)
	}
	switch output {
	case "json":
		_, err := stdout.Write(body)
		return err
	case "yaml":
		var v any // the daemon's document as it is, fields this version does not know included
		if err := json.Unmarshal(body, &v); err != nil {
			return err
		}
		b, err := yaml.Marshal(v)
		if err != nil {
			return err
		}
		_, err = stdout.Write(b)
		return err
	}
	printStatus(stdout, doc, time.Now())
	return nil
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

// printStatus prints the document as a table a person reads at a glance.
func printStatus(w io.Writer, doc statusDoc, now time.Time) {
	if in := doc.Instance; in.Role != "" && in.Role != roleServing {
		since := ""
		if in.Since != nil {
			since = " for " + age(now.Sub(*in.Since))
		}
		fmt.Fprintf(w, "instance %s%s: %s\n", in.Role, since, in.Detail)
		return
	}
	if doc.Instance.Inherited > 0 {
		fmt.Fprintf(w, "instance serving: %s, %d sockets taken over\n", doc.Instance.Detail, doc.Instance.Inherited)
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
	registered, absent := 0, 0
	for _, d := range doc.Drivers {
		switch {
		case d.Phase == phaseRegistered:
			registered++
		case d.Absent:
			absent++
		}
	}
	fmt.Fprintf(w, "%d of %d drivers registered", registered, len(doc.Drivers))
	if absent > 0 {
		fmt.Fprintf(w, ", %d absent from this node", absent)
	}
	fmt.Fprint(w, "\n\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	// KUBELET, what kubelet's pod-resources API says of a device plugin's resource, only
	// where it says something.
	kubeletCol := slices.ContainsFunc(doc.Drivers, func(d driverStatus) bool { return d.Kubelet != nil })
	header := "DRIVER\tTYPE\tPHASE\tSINCE\tATTEMPTS\tFAILURES\tNEXT RETRY\t"
	if kubeletCol {
		header += "KUBELET\t"
	}
	fmt.Fprintln(tw, header+"LAST ERROR")
	for _, d := range doc.Drivers {
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
		kubelet := "-"
		if k := d.Kubelet; k != nil {
			kubelet = fmt.Sprintf("%d devices", k.Devices)
			if k.Missing && k.ReadAt != nil && k.Since != nil {
				kubelet = fmt.Sprintf("NONE for %s", age(k.ReadAt.Sub(*k.Since)))
				lastErr = strings.TrimPrefix(lastErr+"; kubelet holds no device of the registered resource", "; ")
			}
		}
		if lastErr == "" {
			lastErr = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t", d.Name, d.Type, phase, since, d.Attempts, d.Failures, next)
		if kubeletCol {
			fmt.Fprintf(tw, "%s\t", kubelet)
		}
		fmt.Fprintf(tw, "%s\n", lastErr)
	}
	tw.Flush()
}

// age renders a duration as kubectl renders ages (3s, 90s, 4m12s, 2h5m, 3d4h); a moment
// already past reads 0s.
func age(d time.Duration) string {
	return duration.HumanDuration(max(d, 0))
}
