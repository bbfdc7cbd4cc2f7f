package registrar

import "sync"

// changes tells whoever watches the drivers' statuses that one may have changed: what their
// status says of kubelet's verdict (the phase, the last error), the endpoint's presence,
// whether the driver is required, or which drivers run. Watching costs nothing until someone
// asks (Supervisor.Changed): a change with no watcher is a lock and a nil check.
type changes struct {
	mu sync.Mutex
	c  chan struct{} // closed at the next change; nil while nobody waits
}

// wait returns a channel closed at the next change.
func (c *changes) wait() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.c == nil {
		c.c = make(chan struct{})
	}
	return c.c
}

// notify closes the channel of those waiting, if any.
func (c *changes) notify() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.c != nil {
		close(c.c)
		c.c = nil
	}
}

// Changed returns a channel closed at the next change of some driver's status that a reader
// of kubelet's verdicts cares about (its phase, last error, presence, whether it is required),
// or of which drivers run. A watcher calls it again after each close, and reads Status.
func (s *Supervisor) Changed() <-chan struct{} {
	return s.env.changes.wait()
}
