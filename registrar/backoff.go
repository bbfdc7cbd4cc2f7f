package registrar

import (
	"math"
	"time"

	"github.com/cenkalti/backoff/v4"

	"multireg.dev/multireg/config"
)

// newBackoff returns the exponential backoff of a driver's policy. It never gives up
// (MaxElapsedTime 0): a driver is retried for as long as it is configured. Reset it after a
// success.
func newBackoff(p config.Backoff) *backoff.ExponentialBackOff {
	b := &backoff.ExponentialBackOff{
		InitialInterval:     p.InitialInterval,
		RandomizationFactor: p.RandomizationFactor,
		Multiplier:          p.Multiplier,
		MaxInterval:         p.MaxInterval,
		MaxElapsedTime:      0,
		Stop:                backoff.Stop,
		Clock:               backoff.SystemClock,
	}
	b.Reset()
	return b
}

// next returns the next wait of b; it never returns backoff.Stop because MaxElapsedTime is 0.
func next(b *backoff.ExponentialBackOff) time.Duration {
	d := b.NextBackOff()
	if d == backoff.Stop {
		return b.MaxInterval
	}
	return d
}

// maxTimeoutFactor caps the registration timeout in force at this many times the configured
// one.
const maxTimeoutFactor = 32

// pacing paces one driver's registration attempts: the backoff between failed attempts, and
// the registration timeout in force.
//
// The timeout grows after each attempt that timed out, by the backoff's multiplier (at least
// 2), up to maxTimeoutFactor times the configured one, and is back to the configured one after
// a registration. kubelet's RegisterPlugin (for CSI, NodeGetInfo and the CSINode update) runs
// between GetInfo and NotifyRegistrationStatus: when it takes longer than the configured
// timeout, a fixed timeout would recreate the socket before every verdict, forever. Starting
// the timer at GetInfo would not help there, and growing also covers a kubelet whose own
// backoff delays its GetInfo.
type pacing struct {
	backoff *backoff.ExponentialBackOff
	timeout time.Duration // in force; 0 disables it
	base    time.Duration // the configured registrationTimeout
	factor  float64
	// failures counts the waits taken from backoff since it was last reset: a hand-over
	// replays them, so that the curve goes on where it stood.
	failures int
}

func newPacing(spec config.Driver) *pacing {
	return &pacing{
		backoff: newBackoff(spec.Backoff),
		timeout: spec.RegistrationTimeout,
		base:    spec.RegistrationTimeout,
		factor:  max(spec.Backoff.Multiplier, 2),
	}
}

// registered resets the backoff and the timeout after kubelet accepted the driver.
func (p *pacing) registered() {
	p.backoff.Reset()
	p.failures = 0
	p.timeout = p.base
}

// wait returns the wait after a failed attempt.
func (p *pacing) wait() time.Duration {
	p.failures++
	return next(p.backoff)
}

// takeOver takes the state another instance's pacing of the driver had (a hand-over): the
// timeout in force and the backoff's failures, within the bounds this policy allows.
func (p *pacing) takeOver(timeout time.Duration, failures int) {
	p.goOn(timeout, failures)
}

// setPolicy takes a new policy of the driver (a reload): the backoff goes on where it stood,
// its failures replayed on the new curve, and a timeout grown after timeouts stays grown by as
// much over the new registrationTimeout (at most maxTimeoutFactor times it). It returns the
// wait the new curve gives the last failure replayed (0: none): what a backoff under way waits
// under the new policy.
func (p *pacing) setPolicy(spec config.Driver) time.Duration {
	grown := 1.0
	if p.base > 0 && p.timeout > p.base {
		grown = float64(p.timeout) / float64(p.base)
	}
	failures := p.failures
	*p = *newPacing(spec)
	var timeout time.Duration
	if f := min(float64(p.base)*grown, float64(p.maxTimeout())); f >= math.MaxInt64 {
		timeout = math.MaxInt64
	} else {
		timeout = time.Duration(f).Round(time.Millisecond)
	}
	return p.goOn(timeout, failures)
}

// goOn makes a fresh pacing go on from a timeout in force and a count of failures: the timeout
// is kept when it is at least the configured one (at most maxTimeout), and the failures are
// replayed on the backoff (at most 64 of them: the curve has long reached maxInterval). It
// returns the last wait replayed (0: none).
func (p *pacing) goOn(timeout time.Duration, failures int) time.Duration {
	if p.base > 0 && timeout >= p.base {
		p.timeout = min(timeout, p.maxTimeout())
	}
	var last time.Duration
	for range min(failures, 64) {
		last = p.wait()
	}
	return last
}

// maxTimeout is the longest timeout the policy allows: maxTimeoutFactor times the configured
// one, or centuries.
func (p *pacing) maxTimeout() time.Duration {
	if p.base > math.MaxInt64/maxTimeoutFactor {
		return math.MaxInt64
	}
	return p.base * maxTimeoutFactor
}

// timedOut grows the timeout for the next attempt and returns it.
func (p *pacing) timedOut() time.Duration {
	grown := min(float64(p.timeout)*p.factor, float64(p.maxTimeout()))
	if grown >= math.MaxInt64 {
		p.timeout = math.MaxInt64 // a configured timeout of centuries
	} else {
		p.timeout = time.Duration(grown).Round(time.Millisecond)
	}
	return p.timeout
}
