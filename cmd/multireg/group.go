//go:build linux

package main

import "errors"

// group runs actors together until the first of them returns, then stops the others in the
// reverse of the order they were added, each only once every actor added after it has
// returned: what was added first (the HTTP server) stops last. The model is oklog/run's
// Group, with an ordered shutdown.
type group struct {
	actors []actor
}

type actor struct {
	execute func() error
	// interrupt makes execute return. It gets the error of the actor that returned first.
	interrupt func(error)
}

func (g *group) add(execute func() error, interrupt func(error)) {
	g.actors = append(g.actors, actor{execute, interrupt})
}

// run runs every actor and returns when all have returned, with their errors joined, the
// first actor's first. Every goroutine it starts has returned by then.
func (g *group) run() error {
	type result struct {
		i   int
		err error
	}
	results := make(chan result, len(g.actors))
	for i, a := range g.actors {
		go func() { results <- result{i, a.execute()} }()
	}
	done := make([]bool, len(g.actors))
	var errs []error
	collect := func() error {
		r := <-results
		done[r.i] = true
		errs = append(errs, r.err)
		return r.err
	}
	first := collect()
	for i := len(g.actors) - 1; i >= 0; i-- {
		if done[i] {
			continue
		}
		g.actors[i].interrupt(first)
		for !done[i] {
			collect()
		}
	}
	return errors.Join(errs...)
}
