package nodecond

// The node condition runs in a process of its own, the agent (cmd/multireg-nodecond): only it
// links the Kubernetes API client, so that a multireg without the condition carries none of
// it (BENCHMARKS.md: 4.4 MiB of resident memory at 1000 drivers, the feature off), and a
// failing API server, or the client itself, can take nothing of the registrar down with it.
// multireg starts it with the condition's flags (AgentArgs) and speaks to it over the agent's
// standard input and output, one JSON message per line: multireg sends what the condition is
// decided from each time it changes (ToAgent.Input) and, at an uninstall's exit, Withdraw; the
// agent answers Ready once it has its client, then its Status each time it changes, and
// Withdrawn. Its log goes to its standard error, which multireg passes on as its own.

// AgentName is the agent's executable, beside multireg's own (the image holds both).
const AgentName = "multireg-nodecond"

// AgentProtocol is the version of the messages between multireg and its agent: the agent is
// always the one beside multireg, of the same build, and refuses another version.
const AgentProtocol = 1

// ToAgent is a message from multireg to its agent.
type ToAgent struct {
	// Input: the drivers' state and kubelet's pod-resources view, as they are now.
	Input *Input `json:"input,omitempty"`
	// Withdraw: multireg withdrew every registration on its way out (--cleanup-on-exit); the
	// agent writes the condition Unknown (ReasonStopped), answers Withdrawn and exits.
	Withdraw bool `json:"withdraw,omitempty"`
}

// FromAgent is a message from the agent to multireg.
type FromAgent struct {
	// Ready: the agent speaks Protocol and has its API client (it may not answer yet).
	Ready *Ready `json:"ready,omitempty"`
	// Status: what the agent knows now.
	Status *Status `json:"status,omitempty"`
	// Withdrawn: the answer to Withdraw; Error says why the condition could not be written.
	Withdrawn *Withdrawn `json:"withdrawn,omitempty"`
}

// Ready is the agent's first message.
type Ready struct {
	Protocol int `json:"protocol"`
}

// Withdrawn answers Withdraw.
type Withdrawn struct {
	Error string `json:"error,omitempty"`
}

// AgentArgs are the agent's arguments for the condition of type typ on node, the API server of
// kubeconfig ("": the pod's service account), the startup taint (nil: none), and the log's
// format and level.
func AgentArgs(typ, node, kubeconfig string, taint *Taint, logFormat, logLevel string) []string {
	args := []string{"--node-condition", typ, "--node-name", node, "--log-format", logFormat, "--log-level", logLevel}
	if kubeconfig != "" {
		args = append(args, "--kubeconfig", kubeconfig)
	}
	if taint != nil {
		args = append(args, "--startup-taint", taint.String())
	}
	return args
}
