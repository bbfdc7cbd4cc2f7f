package main

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/nodecond"
)

// defaultHTTPEndpoint is where `run` serves and `status` asks, unless told otherwise.
const defaultHTTPEndpoint = "127.0.0.1:9809"

// runFlags are the flags of `multireg run`.
type runFlags struct {
	path, logFormat, logLevel, httpAddr string
	verbosity                           int
	cleanup                             bool
	level                               slog.Level // from --log-level or -v
	// podResources is kubelet's pod-resources socket: autoPodResources derives it from the
	// registration directory; "" reads none.
	podResources string
	moves        config.DeviceMoves
	// The node condition (package nodecond): its type ("" turns it off), the node's name, the
	// API server's kubeconfig ("": the pod's service account), and the startup taint to
	// remove ("": none; taint, parsed).
	nodeCondition, nodeName, kubeconfig, startupTaint string
	taint                                             *nodecond.Taint
	// agent is the node condition's agent executable ("": multireg-nodecond beside multireg).
	agent string
	// healthHTTP and healthGRPC: where the drivers' liveness checks are served besides
	// --http-endpoint ("": not).
	healthHTTP, healthGRPC string
}

// autoPodResources: the pod-resources socket beside the registration directory,
// <kubelet root>/pod-resources/kubelet.sock.
const autoPodResources = "auto"

const runAbout = `Register every driver of the drivers file with kubelet, and keep them registered until
SIGTERM: one registration loop per driver, each with its own socket in kubelet's
plugins-registry directory. Edits of the file are applied as they come, touching only the
drivers that changed; an invalid file keeps the last good one running. Linux only.`

const runFooter = `Signals:
  SIGTERM, SIGINT   stop every loop within 5s (calls begun are answered first) and exit 0;
                    the registration sockets stay (kubelet keeps every registration), unless
                    --cleanup-on-exit
  SIGHUP            re-read the drivers file now

Exit codes:
  0   stopped by SIGTERM or SIGINT
  1   the drivers file is missing or invalid at start, or the daemon failed
  2   a usage error (a flag), or not Linux`

// runCommandFlags defines the flags of `multireg run` into f.
func runCommandFlags(f *runFlags) *command {
	c := newCommand("run", "--config FILE [flags]", runAbout)
	c.footer = runFooter
	c.String(&f.path, "config", "FILE", "", "the drivers file (required)")
	c.String(&f.httpAddr, "http-endpoint", "HOST:PORT", defaultHTTPEndpoint, "serve /healthz, /readyz, /status and /metrics on this address; empty disables")
	c.String(&f.logFormat, "log-format", "FORMAT", "text", "log format: text or json")
	c.String(&f.logLevel, "log-level", "LEVEL", "", "log level: debug, info, warn or error (default info; debug adds every kubelet call)")
	c.Int(&f.verbosity, "v", "N", 0, "log verbosity: 0 logs phase changes and failures, 1 or more adds every kubelet call (as --log-level debug)")
	c.Bool(&f.cleanup, "cleanup-on-exit", "remove every registration socket on exit, so kubelet deregisters every plugin (uninstall)")
	c.String(&f.podResources, "pod-resources-socket", "PATH", autoPodResources,
		"kubelet's pod-resources socket, read for what kubelet holds of each device plugin; auto: <kubelet root>/pod-resources/kubelet.sock beside the registration directory; empty: none")
	c.String((*string)(&f.moves), "device-plugin-moves", "MODE", string(config.MovesAuto),
		"how a device plugin's new instance (endpoint pattern) is registered: auto (beside the old one while kubelet's pod-resources API answers and no move since kubelet started dropped the devices, else after it), beside, or after")
	c.String(&f.nodeCondition, "node-condition", "TYPE", "",
		"report on this node's Node object a condition of this type (a domain-prefixed name, e.g. multireg.dev/PluginsRegistered), True only when kubelet holds every required driver as its own records say; empty: no condition, and no Kubernetes API access")
	c.String(&f.nodeName, "node-name", "NAME", "", "the name of this node's Node object (with --node-condition; in a pod, from the downward API's spec.nodeName)")
	c.String(&f.kubeconfig, "kubeconfig", "FILE", "", "the API server's kubeconfig (with --node-condition); empty: the pod's service account")
	c.String(&f.startupTaint, "startup-taint", "KEY[=VALUE]:EFFECT", "",
		"remove this taint from the node the first time the node condition is True on it, and never add it back (with --node-condition)")
	c.String(&f.healthHTTP, "health-endpoint", "HOST:PORT", "",
		"also serve each driver's liveness check, GET /healthz/<driver>, on this address, where a driver pod's httpGet livenessProbe reaches it; empty: only on --http-endpoint")
	c.String(&f.healthGRPC, "health-grpc-endpoint", "HOST:PORT", "",
		"serve the standard gRPC health service on this address, each driver's liveness as the service of its name, for a driver pod's grpc livenessProbe; empty: none")
	c.String(&f.agent, "node-condition-agent", "FILE", "",
		"the node condition's agent, the process that speaks to the Kubernetes API (default: "+nodecond.AgentName+" beside multireg)")
	return c
}

// parseRunFlags parses and checks the flags of `multireg run`, before anything else runs.
func parseRunFlags(args []string, stdout io.Writer, helpOnly bool) (runFlags, error) {
	var f runFlags
	c := runCommandFlags(&f)
	if err := parseOrHelp(c, args, stdout, helpOnly); err != nil {
		return f, err
	}
	if f.path == "" {
		return f, c.usageError("--config is required")
	}
	for _, a := range []struct{ flag, addr string }{{"http-endpoint", f.httpAddr}, {"health-endpoint", f.healthHTTP}, {"health-grpc-endpoint", f.healthGRPC}} {
		if err := checkListenAddr(a.addr); err != nil {
			return f, c.usageError("--%s %q: %v", a.flag, a.addr, err)
		}
	}
	if f.logFormat != "text" && f.logFormat != "json" {
		return f, c.usageError("--log-format %q: must be text or json", f.logFormat)
	}
	moves, err := config.ParseDeviceMoves(string(f.moves))
	if err != nil {
		return f, c.usageError("--device-plugin-moves %v", err)
	}
	f.moves = moves
	if f.verbosity < 0 {
		return f, c.usageError("-v %d: must be 0 or more", f.verbosity)
	}
	if err := checkNodeCondition(&f); err != nil {
		return f, c.usageError("%v", err)
	}
	f.level = slog.LevelInfo
	if f.verbosity > 0 {
		f.level = slog.LevelDebug
	}
	if f.logLevel != "" {
		if f.verbosity > 0 && !strings.EqualFold(f.logLevel, "debug") {
			return f, c.usageError("-v %d and --log-level %s disagree: give one of them", f.verbosity, f.logLevel)
		}
		if err := f.level.UnmarshalText([]byte(f.logLevel)); err != nil || !strings.EqualFold(f.logLevel, f.level.String()) {
			return f, c.usageError("--log-level %q: must be debug, info, warn or error", f.logLevel)
		}
	}
	return f, nil
}

// checkNodeCondition checks the node condition's flags: a type with a domain prefix and a node
// name, the startup taint as kubelet's --register-with-taints writes one; and no flag of it
// without --node-condition.
func checkNodeCondition(f *runFlags) error {
	if f.nodeCondition == "" {
		for _, o := range []struct{ name, value string }{{"node-name", f.nodeName}, {"kubeconfig", f.kubeconfig}, {"startup-taint", f.startupTaint}, {"node-condition-agent", f.agent}} {
			if o.value != "" {
				return fmt.Errorf("--%s %q is read only with --node-condition", o.name, o.value)
			}
		}
		return nil
	}
	if err := nodecond.CheckConditionType(f.nodeCondition); err != nil {
		return fmt.Errorf("--node-condition %v", err)
	}
	if f.nodeName == "" {
		return fmt.Errorf("--node-condition %q needs --node-name: the name of this node's Node object", f.nodeCondition)
	}
	if errs := validation.IsDNS1123Subdomain(f.nodeName); len(errs) > 0 {
		return fmt.Errorf("--node-name %q: %s", f.nodeName, strings.Join(errs, "; "))
	}
	if f.startupTaint != "" {
		t, err := nodecond.ParseTaint(f.startupTaint)
		if err != nil {
			return fmt.Errorf("--startup-taint %v", err)
		}
		f.taint = &t
	}
	return nil
}

// checkListenAddr checks an --http-endpoint value before anything else runs: host:port with
// a port number or service name; empty disables the server.
func checkListenAddr(addr string) error {
	if addr == "" {
		return nil
	}
	if strings.Contains(addr, "://") {
		return fmt.Errorf("an address to listen on is host:port, not a URL")
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return err
	}
	return nil
}

// newLogger returns the process logger: text or JSON on w, at the level of the flags.
func newLogger(w io.Writer, f runFlags) *slog.Logger {
	opts := &slog.HandlerOptions{Level: f.level}
	if f.logFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
