package node_test

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// 5b. An upgrade to this build from a release without hand-overs (build-release.sh: the last
// commit before them), with the shipped surge. The DaemonSet of scenario 5 is deleted (its
// sockets stay: no --cleanup-on-exit) and applied again as shipped with the release's image,
// pulled from the test's registry by its tag; then `kubectl set image` to this build's image by
// its tag (VERSION): no image on the node has that name yet (scenario 5 pulled it by digest),
// so kubelet pulls, and containerd resolves the tag at the registry to the index whose content
// it holds already. Both pods run exactly their image index (assertRuns). The release neither
// serves nor asks for a hand-over: the new pod finds none, stands by Ready, the controller
// deletes the old pod, and the new one takes the directory and renames fresh sockets over the
// release's (a DRA driver's in its other registration path, which kubelet holds none of: a new
// DRA registration never replaces one kubelet may hold). That is the cost of an upgrade without
// hand-over, measured: kubelet registers each driver once more (once, each: its plugin
// manager's log), each CSI driver leaves CSINode once (how long is reported), and every
// endpoint is asked again.
func scenarioUpgradeFromRelease(t *testing.T, env *dsEnv) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, *releaseBin, "version").Output()
	if err != nil {
		t.Fatalf("%s version: %v", *releaseBin, err)
	}
	release := strings.TrimSpace(string(out))
	version := strings.Fields(release)[1] // multireg VERSION (commit …)

	// The release, as shipped.
	if out, err := cl.Kubectl(ctx, "delete", "daemonset", "-n", "kube-system", "multireg", "--wait=true", "--timeout=90s"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	waitNoPods(t)
	start := time.Now()
	mark := markRegistry()
	env.apply(t, releaseImage.Tag())
	pod := waitPodReady(t, 3*time.Minute, "")
	figures = append(figures, "release by tag: "+assertRuns(t, pod.Name, releaseImage, releaseImage.Tag(), fetched, mark))
	env.waitNode(t, "the release in pod "+pod.Name, podStatusURL(pod))
	t.Logf("%s: pod %s Ready, every driver registered, %.1fs after kubectl apply -k", release, pod.Name, time.Since(start).Seconds())
	if relLog, err := cl.Kubectl(ctx, "logs", "-n", "kube-system", pod.Name); err != nil {
		t.Fatal(err)
	} else if !strings.Contains(relLog, fmt.Sprintf(`"version":%q`, version)) {
		t.Fatalf("pod %s does not run the release %s:\n%s", pod.Name, version, relLog)
	}

	// The upgrade.
	socks := idents(t, dsDrivers...)
	paths := map[string][]string{} // each driver's registration socket before the upgrade, and after
	for _, n := range dsDrivers {
		paths[n] = []string{socketOf(t, n)}
	}
	counts := env.counts()
	logFrom := kubeletLogSize(t)
	w := watchCSINode(t)
	mark = markRegistry()
	r := followRollout(t, pod, "set", "image", "-n", "kube-system", "daemonset/multireg", "multireg="+underTest.Tag())
	figures = append(figures, "upgrade by tag: "+assertRuns(t, r.pod.Name, underTest, underTest.Tag(), resolved, mark))
	st := env.waitNode(t, "multireg in pod "+r.pod.Name, podStatusURL(r.pod))
	waitUntil(t, 60*time.Second, "kubelet asks every endpoint anew", func(context.Context) (bool, string) {
		now := env.counts()
		return now.nodeGetInfoD > counts.nodeGetInfoD && now.nodeGetInfoE > counts.nodeGetInfoE && now.nodeGetInfoZ > counts.nodeGetInfoZ &&
				now.listAndWatchOpened > counts.listAndWatchOpened && now.listAndWatchOpen == 1 && now.draConnections > counts.draConnections,
			fmt.Sprintf("%v; before: %v", now, counts)
	})
	gaps := w.catchUp(t)
	// A DRA driver's registration goes in its other path (the one kubelet holds none of:
	// registrar's withdrawsFirst), the others' at the release's paths: kubelet's lines about
	// either path count.
	for _, n := range dsDrivers {
		if s := socketOf(t, n); s != paths[n][0] {
			paths[n] = append(paths[n], s)
		}
	}
	events := pluginManagerEventsAt(t, logFrom, paths)
	inst, _, err := statusDocAt(ctx, podStatusURL(r.pod))
	if err != nil {
		t.Fatal(err)
	}
	newLog, err := cl.Kubectl(ctx, "logs", "-n", "kube-system", r.pod.Name)
	if err != nil {
		t.Fatal(err)
	}

	line := r.report(t, "upgrade from "+version+" (standby)")
	longest := reportGaps(t, "upgrade", gaps)
	var registered []string
	for _, n := range dsDrivers {
		registered = append(registered, fmt.Sprintf("%s %d/%d", n,
			count(events[n], "OperationExecutor.UnregisterPlugin started"), count(events[n], "OperationExecutor.RegisterPlugin started")))
	}
	t.Logf("  kubelet's plugin manager, deregistrations/registrations started: %s; endpoints: %v (before: %v); %s allocatable short for %s",
		strings.Join(registered, ", "), env.counts(), counts, gadget, r.short.total.Round(time.Millisecond))
	t.Logf("  new pod's /status instance: %+v", inst)
	figures = append(figures, line, fmt.Sprintf("upgrade from %s (standby): longest CSINode absence %s; %s allocatable short for %s; kubelet's plugin manager deregistrations/registrations: %s",
		version, longest.Round(time.Millisecond), gadget, r.short.total.Round(time.Millisecond), strings.Join(registered, ", ")))

	t.Logf("  the new pod's log:\n%s", strings.Join(linesWith(newLog, "hand-over", "standing by", "took over", "serving the registration directory"), "\n"))

	// Today's cost, once: each driver registered once more on a fresh socket, each CSI driver
	// out of CSINode once, for kubelet's re-registration of a recreated socket (a reconcile
	// pass or two).
	for _, n := range dsDrivers {
		if c := count(events[n], "OperationExecutor.RegisterPlugin started"); c != 1 {
			t.Errorf("kubelet's plugin manager started %d registration(s) of %s during the upgrade; want 1:\n%s", c, n, strings.Join(events[n], "\n"))
		}
		if st[n].Attempts != 1 || st[n].Failures != 0 {
			t.Errorf("%s in the new pod: %+v; want registered on its first socket", n, st[n])
		}
	}
	now := idents(t, dsDrivers...)
	for _, n := range dsDrivers {
		if now[n] == socks[n] {
			t.Errorf("%s's registration socket is the release's: the new pod did not publish its own", n)
		}
	}
	for _, n := range []string{csiD, csiE, csiZ} {
		if len(gaps[n]) != 1 {
			t.Errorf("%s left CSINode %d time(s) during the upgrade (%v); want once", n, len(gaps[n]), gaps[n])
		}
	}
	if longest > 3*time.Second {
		t.Errorf("a driver was missing from CSINode for %s during the upgrade (bound 3s: kubelet's own re-registration, a reconcile pass or two)", longest)
	}
	// The new pod says what happened: no hand-over, a standby (Ready) until the release's pod
	// was deleted, then the directory taken with nothing handed over.
	for _, msg := range []string{msgNoHandover, msgStandby} {
		if !strings.Contains(newLog, msg) {
			t.Errorf("the new pod %s's log does not say %q:\n%s", r.pod.Name, msg, newLog)
		}
	}
	if strings.Contains(newLog, msgTookOver) || strings.Contains(r.oldLog, msgHanded) || !strings.Contains(r.oldLog, msgStopped) {
		t.Errorf("a hand-over in the logs of a release without them, or the release did not stop cleanly:\nold pod %s:\n%s\nnew pod %s:\n%s", pod.Name, r.oldLog, r.pod.Name, newLog)
	}
	if roles := r.roles[r.pod.Name]; !slices.Contains(roles, "standby") || roles[len(roles)-1] != "serving" { // done: serving
		t.Errorf("the new pod's roles in /status during the upgrade: %v; want standby, then serving", roles)
	}
	if inst.Role != "serving" || inst.Inherited != 0 {
		t.Errorf("the new pod's /status instance: %+v; want serving, nothing inherited", inst)
	}
}
