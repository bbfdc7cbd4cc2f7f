package faults

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
	"multireg.dev/multireg/e2e/testenv"
)

// Fault: RLIMIT_NOFILE too low for the drivers. 60 drivers under 64: the sockets that fit are served and
// registered by kubelet, the others say why in /status, /readyz names what does not fit, the
// HTTP API answers throughout, and a config the limit fits is read and applied.
func TestTooFewDescriptors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ds := testenv.Mixed("fd", 60)
	e.StartEndpoints(ds)
	p := mrproc.StartWith(t, mrproc.Options{NoFile: 64}, e.WriteConfig(ds))

	var room int
	wait.Every(t, requestPoll, registerTimeout, "the drivers that fit registered, the others saying why", func() bool {
		st := p.Status(t)
		if st.Descriptors == nil || st.Descriptors.Limit != 64 || st.Descriptors.Fits || st.Descriptors.Needed != len(ds) {
			return false
		}
		room = st.Descriptors.MaxSockets
		registered, unfit := 0, 0
		for _, d := range st.Drivers {
			switch {
			case d.Phase == "Registered" && e.K.Registered(d.Name):
				registered++
			case strings.Contains(d.LastError, "no file descriptor left for the registration socket"):
				unfit++
			}
		}
		return room > 0 && registered == room && unfit == len(ds)-room
	})
	t.Logf("RLIMIT_NOFILE 64: room for %d registration sockets", room)
	if !p.Healthy(t) {
		t.Error("/healthz does not answer 200")
	}
	code, body, err := p.Get(t, "/readyz")
	want := fmt.Sprintf("file descriptors: the %d drivers need %d registration sockets, and RLIMIT_NOFILE 64 leaves room for %d", len(ds), len(ds), room)
	if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, want) {
		t.Errorf("/readyz: %d %v\n%s\nwant 503 with %q", code, err, body, want)
	}

	// A config that fits is read and applied: every driver left registers.
	fit := ds[:room/2]
	e.WriteConfig(fit)
	wait.Every(t, requestPoll, registerTimeout, "the drivers of a config that fits registered", func() bool {
		st := p.Status(t)
		code, _, _ := p.Get(t, "/readyz")
		return st.Descriptors != nil && st.Descriptors.Fits && code == http.StatusOK && e.AllRegistered(fit)
	})
}
