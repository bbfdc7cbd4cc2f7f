package handover

import (
	"errors"
	"fmt"
	"log/slog"

	"multireg.dev/multireg/config"
)

// What a new instance accepts of a hand-over (the package comment: Bounds): no more than its
// own configuration can use, so that a predecessor that hands over more than any sane batch
// costs it bounded memory, descriptors, reads and log lines. Ask checks each batch against the
// bounds before it keeps anything of it (intake.admit), then keeps of each driver what the new
// instance uses (intake.keep).

const (
	// minRetired is the least number of drivers a new instance accepts that it does not
	// configure, whatever its configuration's size: a rollout that removes that many drivers
	// from a small configuration is still handed over.
	minRetired = 256
	// maxDriverSockets is the most sockets a driver hands over: its current one and a
	// rollover's previous one.
	maxDriverSockets = 2
	// driverBytes is the JSON the batches may carry per driver accepted, on average: about three
	// times what a driver takes whose last error is cut at maxLastError (a batch of 64 drivers
	// is about 1 KiB each, 5 KiB each with a full last error).
	driverBytes = 16 << 10
)

// bounds are what a new instance accepts of a hand-over, from the drivers it configures.
type bounds struct {
	own     map[string]bool // the drivers the new instance configures, by name
	retired int             // the most drivers it accepts that it does not configure
	bytes   int             // the most JSON the batches carry, together
}

// boundsFor is what a new instance that configures the drivers named own accepts: each of them
// once, as many others (minRetired at least), two sockets each, and driverBytes of JSON for
// each on average.
func boundsFor(own []string) bounds {
	b := bounds{own: make(map[string]bool, len(own))}
	for _, name := range own {
		b.own[name] = true
	}
	b.retired = max(len(b.own), minRetired)
	b.bytes = (len(b.own) + b.retired) * driverBytes
	return b
}

// intake is what Ask has accepted of a hand-over so far, against its bounds.
type intake struct {
	bounds
	seen  map[string]bool // every driver received
	bytes int             // the JSON of every batch received
	// configured: drivers the new instance configures, kept whole. retired: drivers it does not
	// configure, kept for their sockets (retiredSockets); ignored: those without one, of which
	// nothing is kept.
	configured, retired, retiredSockets, ignored int
	// outside: sockets that are not registration sockets of the directory, closed; outsideWhy
	// says why of the first.
	outside    int
	outsideWhy error
}

// newIntake is the intake of a new instance that configures the drivers named own.
func newIntake(own []string) *intake {
	return &intake{bounds: boundsFor(own), seen: map[string]bool{}}
}

// admit checks m, a batch of size bytes of JSON whose descriptors fill gave its sockets,
// against the bounds, before anything of it is kept: a batch before the last without drivers, a
// driver handed over twice or with more than maxDriverSockets sockets, more drivers the new
// instance does not configure or more bytes than the bounds allow are errors of the protocol.
func (in *intake) admit(m *Msg, size int) error {
	in.bytes += size
	if in.bytes > in.bounds.bytes {
		return fmt.Errorf("the batches carry more than %d bytes: more than the %d drivers this instance configures and %d others take",
			in.bounds.bytes, len(in.own), in.bounds.retired)
	}
	if !m.Last && len(m.Drivers) == 0 {
		return errors.New("batch: no driver in a batch before the last")
	}
	others := in.retired + in.ignored
	for _, hd := range m.Drivers {
		name := hd.Spec.Name
		if in.seen[name] {
			return fmt.Errorf("batch: driver %q handed over twice", name)
		}
		in.seen[name] = true
		if len(hd.Sockets) > maxDriverSockets {
			return fmt.Errorf("batch: driver %q hands over %d sockets (%d at most: its current one and a rollover's previous one)",
				name, len(hd.Sockets), maxDriverSockets)
		}
		if !in.own[name] {
			others++
		}
	}
	if others > in.bounds.retired {
		return fmt.Errorf("more than %d drivers handed over that this instance does not configure (it accepts as many as the %d it configures, "+
			"and %d at least); their sockets are removed once the previous instance has exited", in.bounds.retired, len(in.own), minRetired)
	}
	return nil
}

// keep puts hd, a driver of a batch admitted, in snap as far as the new instance uses it:
// whole if it configures it; otherwise its sockets alone (retire), to withdraw them once it
// holds the directory, or nothing when none is left. Its sockets that are not registration
// sockets of dir are closed first (keepInside).
func (in *intake) keep(snap *Snapshot, hd *Driver, dir string) {
	n, why := keepInside(hd, dir)
	in.outside += n
	if in.outsideWhy == nil {
		in.outsideWhy = why
	}
	switch {
	case in.own[hd.Spec.Name]:
		in.configured++
		snap.Add(hd)
	case len(hd.Sockets) > 0:
		in.retired++
		in.retiredSockets += len(hd.Sockets)
		snap.Add(hd.retire())
	default:
		in.ignored++
	}
}

// log says in one line what the batches received whole brought and what of it is kept, if
// anything came.
func (in *intake) log(log *slog.Logger) {
	n := in.configured + in.retired + in.ignored
	if n == 0 {
		return
	}
	attrs := []any{"drivers", n, "configured", in.configured,
		"notConfigured", in.retired + in.ignored, "socketsToWithdraw", in.retiredSockets}
	if in.outside == 0 {
		log.Info("received the previous instance's drivers: this instance keeps those it configures, and withdraws the sockets of the others", attrs...)
		return
	}
	attrs = append(attrs, "socketsIgnored", in.outside, "why", in.outsideWhy)
	log.Warn("received the previous instance's drivers: this instance keeps those it configures, and withdraws the sockets of the others; "+
		"sockets that are not registration sockets of this directory are ignored", attrs...)
}

// retire is what a new instance keeps of a handed driver it does not configure: its name, and
// its sockets' paths, identities and descriptors, to withdraw them once it holds the directory
// (Withdraw). The rest is of no use to it. A retired driver registers as no configured driver
// does (RegistersAs): a loop that took it would register anew.
func (h *Driver) retire() *Driver {
	r := &Driver{Spec: config.Driver{Registration: config.Registration{Name: h.Spec.Name}}}
	for _, hs := range h.Sockets {
		r.Sockets = append(r.Sockets, &Socket{Path: hs.Path, ID: hs.ID, File: hs.File})
	}
	return r
}
