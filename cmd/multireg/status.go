package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/util/duration"

	"multireg.dev/multireg/registrar"
	"multireg.dev/multireg/reload"
)

// statusDoc is the JSON document of GET /status and `multireg status -o json`.
type statusDoc struct {
	Instance instanceStatus `json:"instance"`
	Config   configStatus   `json:"config"`
	Drivers  []driverStatus `json:"drivers"`
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
	Attempts    int        `json:"attempts"`
	Failures    int        `json:"failures"`
	LastError   string     `json:"lastError"`
	Since       *time.Time `json:"since"`
	NextAttempt *time.Time `json:"nextAttempt"`
}

// newStatusDoc renders the process's state; times are RFC 3339 (UTC), absent ones null. A
// process that does not serve the directory has no configuration applied and no drivers.
func newStatusDoc(v instanceView) statusDoc {
	var cfg reload.State
	var drivers []registrar.DriverStatus
	if v.State != nil {
		cfg, drivers = v.State.config(), v.State.drivers()
	}
	doc := statusDoc{
		Instance: instanceStatus{Role: v.Role, Since: timePtr(v.Since), Detail: v.Detail, Inherited: v.Inherited},
		Config: configStatus{
			Path:                 cfg.Path,
			Generation:           cfg.Generation,
			LastReloadSuccessful: cfg.LastReloadSuccessful,
			LastReloadError:      cfg.LastReloadError,
			LastReloadTime:       timePtr(cfg.LastReloadTime),
		},
		Drivers: make([]driverStatus, 0, len(drivers)),
	}
	for _, d := range drivers { // sorted by name
		doc.Drivers = append(doc.Drivers, driverStatus{
			Name:        d.Name,
			Type:        d.Type,
			Phase:       string(d.Phase),
			Socket:      d.Socket,
			Endpoint:    d.Endpoint,
			EndpointUp:  d.EndpointUp,
			Absent:      d.Absent,
			Required:    d.Required,
			Attempts:    d.Attempts,
			Failures:    d.Failures,
			LastError:   d.LastError,
			Since:       timePtr(d.Since),
			NextAttempt: timePtr(d.NextAttempt),
		})
	}
	return doc
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC().Truncate(time.Millisecond)
	return &t
}

// statusTimeout bounds `multireg status`'s request.
const statusTimeout = 5 * time.Second

// runStatus is `multireg status`: it asks the running daemon for its state and prints it.
func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", stderr)
	addr := fs.String("http-endpoint", defaultHTTPEndpoint, "the daemon's --http-endpoint")
	output := fs.String("o", "table", "output: table or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *output != "table" && *output != "json" {
		return usagef("multireg status: -o %q: must be table or json", *output)
	}
	url := "http://" + dialAddress(*addr) + "/status"
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return usagef("multireg status: --http-endpoint %q: %v", *addr, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("multireg status: no answer from the daemon at %s: %v (is `multireg run` running, with the same --http-endpoint?)", *addr, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("multireg status: read the answer from %s: %w", *addr, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("multireg status: %s answered %s", url, resp.Status)
	}
	var doc statusDoc
	if err := json.Unmarshal(body, &doc); err != nil {
		return fmt.Errorf("multireg status: %s did not answer with a status document: %w", url, err)
	}
	if *output == "json" {
		_, err := stdout.Write(body)
		return err
	}
	printStatus(stdout, doc, time.Now())
	return nil
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
	registered, absent := 0, 0
	for _, d := range doc.Drivers {
		switch {
		case d.Phase == string(registrar.Registered):
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
	fmt.Fprintln(tw, "DRIVER\tTYPE\tPHASE\tSINCE\tATTEMPTS\tFAILURES\tNEXT RETRY\tLAST ERROR")
	for _, d := range doc.Drivers {
		since, next := "-", "-"
		if d.Since != nil {
			since = age(now.Sub(*d.Since))
		}
		if d.NextAttempt != nil {
			next = "in " + age(d.NextAttempt.Sub(now))
		}
		lastErr := d.LastError
		if !d.EndpointUp && d.Phase == string(registrar.Registered) {
			lastErr = strings.TrimSuffix("endpoint down; "+lastErr, "; ")
		}
		if lastErr == "" {
			lastErr = "-"
		}
		phase := d.Phase
		if d.Absent && d.Phase != string(registrar.Registered) {
			// Not on this node: the probe's error would only say so again.
			phase, lastErr = "Absent", "-"
			if d.Required {
				lastErr = "required on every node: not ready"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", d.Name, d.Type, phase, since, d.Attempts, d.Failures, next, lastErr)
	}
	tw.Flush()
}

// age renders a duration as kubectl renders ages (3s, 90s, 4m12s, 2h5m, 3d4h); a moment
// already past reads 0s.
func age(d time.Duration) string {
	return duration.HumanDuration(max(d, 0))
}
