package testkit

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// RunUntilEnd runs run in a goroutine until the test ends: then its context is cancelled and
// the test waits for it to return.
func RunUntilEnd(t testing.TB, run func(context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// watchLimitEnv tells a test process that it runs in a user namespace of its own, and which
// inotify limit to set there: "<the parent's user namespace>,<limit's file>,<value>".
const watchLimitEnv = "MULTIREG_TEST_INOTIFY_WATCHES"

// AtWatchLimit runs the calling test at inotify's watch limit. inotify's limit is per user
// namespace: the test runs again in a child process, in a user namespace of its own whose
// limit is watches; nothing outside the child is touched. It returns true in the child, where
// the test goes on, and false in the parent, which has reported the child's result.
func AtWatchLimit(t *testing.T, watches int) bool {
	t.Helper()
	return atInotifyLimit(t, "max_inotify_watches", watches)
}

// AtInstanceLimit is AtWatchLimit for inotify's limit on instances.
func AtInstanceLimit(t *testing.T, instances int) bool {
	t.Helper()
	return atInotifyLimit(t, "max_inotify_instances", instances)
}

// atInotifyLimit runs the calling test with /proc/sys/user/<limit> at value.
func atInotifyLimit(t *testing.T, limit string, value int) bool {
	t.Helper()
	self, err := os.Readlink("/proc/self/ns/user")
	if err != nil {
		t.Skipf("no user namespaces: %v", err)
	}
	if v := os.Getenv(watchLimitEnv); v != "" {
		parts := strings.SplitN(v, ",", 3)
		if len(parts) != 3 || self == parts[0] {
			t.Fatalf("the child runs in its parent's user namespace (%s): the host's inotify limit is left alone", self)
		}
		if err := os.WriteFile("/proc/sys/user/"+parts[1], []byte(parts[2]), 0); err != nil {
			t.Fatal(err)
		}
		return true
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s,%s,%d", watchLimitEnv, self, limit, value))
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	out, err := cmd.CombinedOutput()
	if _, exited := errors.AsType[*exec.ExitError](err); err != nil && !exited {
		t.Skipf("cannot start a process in a user namespace of its own: %v", err)
	}
	t.Logf("at %s %d:\n%s", limit, value, out)
	if err != nil {
		t.Fatalf("the test failed at the watch limit: %v", err)
	}
	return false
}
