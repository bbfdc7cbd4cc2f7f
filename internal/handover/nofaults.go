//go:build !multireg_faults

package handover

import "log/slog"

// A build without the tag multireg_faults (every release) injects no fault: faults.go is the
// end-to-end tests' build.

// pinnedVersion: the versions spoken are never pinned.
func pinnedVersion() (int, bool) { return 0, false }

// halt never blocks a hand-over.
func halt(*slog.Logger, string, string, ...any) {}
