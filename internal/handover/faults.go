//go:build multireg_faults

package handover

import (
	"log/slog"
	"os"
	"strconv"
)

// Fault injection for the end-to-end tests, compiled only with the build tag multireg_faults
// (nofaults.go is the release's): the package comment says what each variable does.

// pinnedVersion is the one protocol version MULTIREG_TEST_HANDOVER_PROTOCOL pins this process
// to, if it is set (0: none).
func pinnedVersion() (int, bool) {
	v, err := strconv.Atoi(os.Getenv("MULTIREG_TEST_HANDOVER_PROTOCOL"))
	return v, err == nil
}

// halt blocks the hand-over at the step MULTIREG_TEST_HANDOVER_HALT names ("<side>:<step>"),
// after logging it, until the process is killed.
func halt(log *slog.Logger, side, step string, args ...any) {
	if os.Getenv("MULTIREG_TEST_HANDOVER_HALT") != side+":"+step {
		return
	}
	log.Warn("hand-over halted for a test", append([]any{"side", side, "step", step}, args...)...)
	select {}
}
