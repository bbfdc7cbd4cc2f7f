package node_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// A rollout of the multireg DaemonSet, looked at from every side while it runs.

// Log lines of multireg's hand-over (cmd/multireg, registrar).
const (
	msgTookOver   = "took over the registration directory from the previous instance"
	msgHanded     = "handed over the registration directory; this instance serves nothing now and exits on SIGTERM"
	msgStandby    = "standing by: ready, and serving nothing until the directory is free"
	msgNoHandover = "no hand-over; waiting for the previous instance to exit"
	msgStopped    = "multireg stopped"
)

// rollout is what was seen of one: at every look (every 100 ms, from the command that started
// it until the node is whole again with the new pod alone), the node's gadgets, which drivers'
// sockets kubelet's plugin manager held, and each pod's role in its /status; and the old pod's
// log.
type rollout struct {
	old, pod corev1.Pod    // the old pod, the new one
	ready    time.Duration // the new pod first seen Ready, after the command
	oldGone  time.Duration // the old pod first seen gone
	// done: the new pod alone, Ready, serving every driver Registered; every gadget
	// allocatable and every driver's socket held by kubelet's plugin manager.
	done time.Duration
	// gadgets counts the looks by what they saw of the gadgets: "capacity/allocatable".
	gadgets map[string]int
	short   shortfall      // of allocatable gadgets
	notHeld map[string]int // driver → looks at which kubelet's plugin manager did not hold it
	heldAt  int            // looks at kubelet's plugin manager
	roles   map[string][]string
	oldLog  string // the old pod's log, until its container ended
}

// followRollout runs `kubectl ARGS…`, which starts a rollout replacing the pod old, and looks
// at the node every 100 ms until the new pod is alone and the node whole (rollout.done; within
// 3 min); meanwhile it follows the old pod's log (kubectl logs -f) until the old container
// ends.
func followRollout(t *testing.T, old corev1.Pod, args ...string) *rollout {
	t.Helper()
	r := &rollout{old: old, gadgets: map[string]int{}, notHeld: map[string]int{}, roles: map[string][]string{}}
	logCtx, cancelLog := context.WithTimeout(context.Background(), 5*time.Minute)
	logDone := make(chan struct{})
	var logErr error
	go func() {
		defer close(logDone)
		r.oldLog, logErr = cl.Kubectl(logCtx, "logs", "-f", "-n", "kube-system", old.Name)
	}()
	defer func() { cancelLog(); <-logDone }()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Each pod's role, looked at every 50 ms apart from the slower looks below (four requests
	// each): a standby can last half a second.
	stopRoles := r.watchRoles()
	defer stopRoles()
	start := time.Now()
	if out, err := cl.Kubectl(ctx, args...); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	waitUntil(t, 3*time.Minute, "the new multireg pod alone, every driver registered from it", func(ctx context.Context) (bool, string) {
		var why []string
		if c, a, err := capacity(ctx, gadget); err != nil {
			why = append(why, err.Error())
		} else {
			r.gadgets[fmt.Sprintf("%d/%d", c, a)]++
			r.short.observe(int(a), nGadgets)
			if c != nGadgets || a != nGadgets {
				why = append(why, fmt.Sprintf("%s %d/%d", gadget, c, a))
			}
		}
		pods, err := multiregPods(ctx)
		if err != nil {
			return false, err.Error()
		}
		var fresh []corev1.Pod
		var states []string
		oldThere := false
		// The socket the new pod registered each driver on: a DRA driver's new registration
		// goes in the path kubelet holds none of (registrar's withdrawsFirst, outside a
		// hand-over), the other registration path, not the one recorded before.
		newSock := map[string]string{}
		for _, p := range pods {
			states = append(states, podState(p))
			if p.UID == old.UID {
				oldThere = true
			} else {
				fresh = append(fresh, p)
			}
			if drivers := r.look(ctx, p); p.UID != old.UID {
				for _, n := range dsDrivers {
					if drivers[n].Phase != "Registered" {
						why = append(why, fmt.Sprintf("%s: %s in %s", n, drivers[n].Phase, p.Name))
					} else {
						newSock[n] = drivers[n].Socket
					}
				}
			}
		}
		// Held: kubelet holds the socket recorded before the rollout or the new pod's; done
		// only once it holds the new pod's.
		if held, err := kubeletRegistered(ctx); err != nil {
			why = append(why, err.Error())
		} else {
			r.heldAt++
			for _, n := range dsDrivers {
				switch ns := newSock[n]; {
				case !held[socketOf(t, n)] && (ns == "" || !held[ns]):
					r.notHeld[n]++
					why = append(why, "kubelet does not hold "+n)
				case ns != "" && !held[ns]:
					why = append(why, fmt.Sprintf("kubelet does not hold %s on the new pod's socket %s yet", n, ns))
				}
			}
		}
		newReady := len(fresh) == 1 && fresh[0].DeletionTimestamp == nil && isReady(fresh[0])
		if newReady && r.ready == 0 {
			r.ready = time.Since(start)
		}
		if !oldThere && r.oldGone == 0 {
			r.oldGone = time.Since(start)
		}
		if !newReady || oldThere || len(why) > 0 {
			return false, fmt.Sprintf("pods %v; %s", states, strings.Join(why, "; "))
		}
		r.pod, r.done = fresh[0], time.Since(start)
		return true, ""
	})
	stopRoles()
	waitUntil(t, 30*time.Second, "the old pod's log ends with its container", func(context.Context) (bool, string) {
		select {
		case <-logDone:
			return true, ""
		default:
			return false, "kubectl logs -f still follows " + old.Name
		}
	})
	if logErr != nil {
		t.Errorf("the old pod's log: %v", logErr)
	}
	if out, err := cl.Kubectl(ctx, "rollout", "status", "-n", "kube-system", "daemonset/multireg", "--timeout=30s"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return r
}

// look reads p's /status and returns the drivers (none when p does not answer).
func (r *rollout) look(ctx context.Context, p corev1.Pod) map[string]driverStatus {
	if p.Status.PodIP == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, drivers, err := statusDocAt(ctx, podStatusURL(p))
	if err != nil {
		return nil
	}
	return drivers
}

// watchRoles reads every multireg pod's /status every 50 ms and records each pod's role when it
// changed since its last one (r.roles), until the returned stop is called (more than once is
// fine); stop returns once the watch has ended, so r.roles is then the caller's alone.
func (r *rollout) watchRoles() (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			if pods, err := multiregPods(ctx); err == nil {
				for _, p := range pods {
					if p.Status.PodIP == "" {
						continue
					}
					lctx, lcancel := context.WithTimeout(ctx, time.Second)
					inst, _, err := statusDocAt(lctx, podStatusURL(p))
					lcancel()
					if err != nil {
						continue
					}
					if seen := r.roles[p.Name]; len(seen) == 0 || seen[len(seen)-1] != inst.Role {
						r.roles[p.Name] = append(seen, inst.Role)
					}
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return func() { cancel(); <-done }
}

// report logs what the looks saw and returns it as one line for the figures.
func (r *rollout) report(t *testing.T, what string) string {
	t.Helper()
	var gadgets []string
	looks := 0
	for s, n := range r.gadgets {
		gadgets = append(gadgets, fmt.Sprintf("%s at %d", s, n))
		looks += n
	}
	sort.Strings(gadgets)
	line := fmt.Sprintf("%s: new pod Ready %.1fs, old pod gone %.1fs, rollout done %.1fs after the command; %s capacity/allocatable %s of %d looks",
		what, r.ready.Seconds(), r.oldGone.Seconds(), r.done.Seconds(), gadget, strings.Join(gadgets, ", "), looks)
	t.Log(line)
	t.Logf("  roles in /status: old pod %s %q, new pod %s %q; kubelet's plugin manager read %d times, drivers not held: %v",
		r.old.Name, r.roles[r.old.Name], r.pod.Name, r.roles[r.pod.Name], r.heldAt, r.notHeld)
	return line
}

// reportGaps logs how long each CSI driver was missing from CSINode and returns the longest
// absence.
func reportGaps(t *testing.T, what string, gaps map[string][]time.Duration) time.Duration {
	t.Helper()
	longest := time.Duration(0)
	for _, n := range []string{csiD, csiE, csiZ} {
		var list []string
		for _, g := range gaps[n] {
			list = append(list, g.Round(time.Millisecond).String())
			longest = max(longest, g)
		}
		t.Logf("  %s: %s missing from CSINode %d time(s) %v", what, n, len(gaps[n]), list)
	}
	return longest
}

// kubeletLogSize is where kubelet's log ends now: pluginManagerEvents reads from there.
func kubeletLogSize(t *testing.T) int64 {
	t.Helper()
	fi, err := os.Stat(cl.LogPath("kubelet"))
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// kubeletLogSince is what kubelet logged since its log was offset bytes long (kubeletLogSize).
func kubeletLogSince(t *testing.T, offset int64) []byte {
	t.Helper()
	f, err := os.Open(cl.LogPath("kubelet"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(offset, 0); err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// What kubelet's plugin manager logs (at --v=2) when it notices a registration socket: its
// watcher adds or removes the socket in the desired state, its reconciler registers or
// deregisters the plugin.
var pluginManagerMessages = []string{
	"Adding socket path or updating timestamp to desired state cache",
	"Removing socket path from desired state cache",
	"OperationExecutor.RegisterPlugin started",
	"OperationExecutor.UnregisterPlugin started",
}

// pluginManagerEvents returns, for each driver, the lines kubelet's plugin manager logged about
// its registration socket since kubelet's log was offset bytes long.
func pluginManagerEvents(t *testing.T, offset int64, names ...string) map[string][]string {
	t.Helper()
	paths := map[string][]string{}
	for _, n := range names {
		paths[n] = []string{socketOf(t, n)}
	}
	return pluginManagerEventsAt(t, offset, paths)
}

// pluginManagerEventsAt returns, for each driver, the lines kubelet's plugin manager logged
// about any of its registration sockets paths[driver] since kubelet's log was offset bytes
// long.
func pluginManagerEventsAt(t *testing.T, offset int64, paths map[string][]string) map[string][]string {
	t.Helper()
	b := kubeletLogSince(t, offset)
	socket := map[string]*regexp.Regexp{}
	for n, ps := range paths {
		var quoted []string
		for _, p := range ps {
			quoted = append(quoted, regexp.QuoteMeta(p))
		}
		socket[n] = regexp.MustCompile(`(` + strings.Join(quoted, "|") + `)($|[^\w.-])`)
	}
	out := map[string][]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if !slices.ContainsFunc(pluginManagerMessages, func(m string) bool { return strings.Contains(line, `"`+m+`"`) }) {
			continue
		}
		for n := range paths {
			if socket[n].MatchString(line) {
				out[n] = append(out[n], line)
			}
		}
	}
	return out
}

// linesWith returns the lines of a log that hold any of msgs.
func linesWith(log string, msgs ...string) []string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if slices.ContainsFunc(msgs, func(m string) bool { return strings.Contains(l, m) }) {
			out = append(out, l)
		}
	}
	return out
}

// count returns how many lines hold msg.
func count(lines []string, msg string) int {
	n := 0
	for _, l := range lines {
		if strings.Contains(l, `"`+msg+`"`) {
			n++
		}
	}
	return n
}
