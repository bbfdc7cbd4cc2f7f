package nodecond

import "time"

// ReasonStopped: multireg withdrew every registration of the node (--cleanup-on-exit, an
// uninstall) and keeps the condition no more: Unknown, not a stale True.
const ReasonStopped = "MultiregStopped"

// Status is what the reporter knows, for /status and the metrics.
type Status struct {
	Type, Node string
	// Verdict is the condition as the drivers, CSINode and pod-resources decide it now.
	Verdict Verdict
	// OnNode is the condition the node shows (nil: none, or the node not read).
	OnNode *Condition
	// NodeRead: the Node has been read; NodeExists: it exists.
	NodeRead, NodeExists bool
	// CSINode: the node's CSINode, as read.
	CSINode CSINode
	// Writes counts the condition's writes that succeeded, WriteErrors those that failed;
	// LastWrite is when the last succeeded, LastError why the last read or write failed
	// ("" once one succeeds).
	Writes, WriteErrors int
	LastWrite           time.Time
	LastError           string
	// Taint is the startup taint, if any; TaintRemoved when this process removed it, and
	// TaintDone once it no longer looks after it (removed, or found absent when the
	// condition was first True).
	Taint        *Taint
	TaintRemoved time.Time
	TaintDone    bool
}

// Condition is a node condition's value as the node shows it.
type Condition struct {
	Status, Reason, Message string
	LastTransitionTime      time.Time
}

// Synced reports whether the node shows the condition as the reporter decided it.
func (s Status) Synced() bool {
	c := s.OnNode
	return c != nil && c.Status == StatusOf(s.Verdict.True) && c.Reason == s.Verdict.Reason && c.Message == s.Verdict.Message
}

// StatusOf is a condition's status for ok.
func StatusOf(ok bool) string {
	if ok {
		return "True"
	}
	return "False"
}
