package registrar

import (
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
