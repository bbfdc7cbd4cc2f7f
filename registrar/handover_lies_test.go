package registrar

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/fsid"
	"multireg.dev/multireg/internal/handover"
	"multireg.dev/multireg/internal/regdir"
	"multireg.dev/multireg/internal/testkit"
)

// TestTakeOverBoundsTheHandedRetry: a driver handed over as backing off until
// 2099 is tried again within its own backoff's longest wait, not parked until then.
func TestTakeOverBoundsTheHandedRetry(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := handoverDrivers(t, dir)[1] // the device plugin; backoff up to 200 ms
	st := handedStatus(DriverStatus{Phase: BackingOff, Failures: 9, NextAttempt: time.Date(2099, 1, 1, 0, 0, 0, 0, time.UTC)})
	snap := &handover.Snapshot{}
	snap.Add(&handover.Driver{Spec: d, Endpoint: d.Endpoint, LocalEndpoint: d.LocalEndpoint, Status: st, Failures: 9})
	s := runSupervisor(t, Options{})
	s.TakeOver(snap)
	start := time.Now()
	s.Start(d)
	if next := statusOf(s, d.Name).NextAttempt; next.After(start.Add(time.Second)) {
		t.Errorf("next attempt %s, want within the backoff's 200 ms (randomized)", next)
	}
	awaitSocket(t, d)
	registerAndWait(t, s, d)
}

// TestTakeOverRefusesADescriptorBoundElsewhere: a predecessor that hands a
// listener bound elsewhere for a path where a dead socket has the identity it claims does not
// get a dead socket reported Registered: the loop publishes its own socket there.
func TestTakeOverRefusesADescriptorBoundElsewhere(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := handoverDrivers(t, dir)[1] // the device plugin
	if err := os.MkdirAll(filepath.Dir(d.SocketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	dead, err := testkit.ListenUnlinked(d.SocketPath)
	if err != nil {
		t.Fatal(err)
	}
	id := mustID(t, d.SocketPath)
	dead.Close() // the file stays, and nothing listens on it
	elsewhere, err := testkit.ListenUnlinked(filepath.Join(dir, "elsewhere.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer elsewhere.Close()
	f, err := elsewhere.File()
	if err != nil {
		t.Fatal(err)
	}
	snap := handedRegistered(d, id, f)
	s := runSupervisor(t, Options{})
	s.TakeOver(snap)
	s.Start(d)
	if n := s.TakenOver(); n != 0 {
		t.Fatalf("%d sockets taken over, want none: the descriptor is not the socket at %s", n, d.SocketPath)
	}
	testkit.Eventually(t, 5*time.Second, "a socket of the loop's own", func() bool {
		now, _, err := fsid.Stat(d.SocketPath)
		return err == nil && now != id
	})
	registerAndWait(t, s, d)
}

// TestHandOverProtocolErrorKeepsTheFirstBatch: a holder whose last batch breaks the protocol
// (version 1 after a welcome in version 2) after a valid first batch costs only the drivers of
// the broken batch and those never sent. The new instance waits for the directory; once the
// holder has ended, it serves the first batch's socket as it was (the same file, Registered,
// no new registration), and registers the others anew on sockets of its own.
func TestHandOverProtocolErrorKeepsTheFirstBatch(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	ds := handoverDrivers(t, dir) // the CSI driver in the first batch, the device plugin in the broken one
	if err := os.MkdirAll(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	handed := func(d config.Driver) (*handover.Driver, *os.File) {
		l, err := testkit.ListenUnlinked(d.SocketPath)
		if err != nil {
			t.Fatal(err)
		}
		f, err := l.File()
		if err != nil {
			t.Fatal(err)
		}
		l.Close() // the file keeps it listening
		t.Cleanup(func() { f.Close() })
		return handedRegistered(d, mustID(t, d.SocketPath), f).Take(d.Name), f
	}
	first, firstFile := handed(ds[0])
	second, secondFile := handed(ds[1])
	kept, other := mustID(t, ds[0].SocketPath), mustID(t, ds[1].SocketPath)
	lock, err := os.OpenFile(filepath.Join(reg, regdir.LockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	answers := fakeHolderSays(t, reg, lock,
		rawMsg{m: &handover.Msg{Type: handover.MsgWelcome, Version: 2}, answer: true},
		rawMsg{m: &handover.Msg{Type: handover.MsgBatch, Version: 2, Drivers: []*handover.Driver{first}, Sockets: 1}, files: []*os.File{firstFile}},
		rawMsg{m: &handover.Msg{Type: handover.MsgBatch, Version: 1, Drivers: []*handover.Driver{second}, Sockets: 1, Last: true, Lock: true}, files: []*os.File{secondFile, lock}, answer: true},
	)
	// The holder ends once it has the answer: its sockets and its lock are closed.
	go func() {
		<-answers
		firstFile.Close()
		secondFile.Close()
		lock.Close()
	}()
	in := startMultireg(t, reg, ds)
	if in.handed != 1 || in.sup.TakenOver() != 1 {
		t.Fatalf("%d drivers kept, %d sockets served; want the first batch's: 1 and 1", in.handed, in.sup.TakenOver())
	}
	if st := statusOf(in.sup, ds[0].Name); st.Phase != Registered || mustID(t, ds[0].SocketPath) != kept {
		t.Errorf("%s: %s, want Registered on the socket handed over", ds[0].Name, st.Phase)
	}
	testkit.Eventually(t, 5*time.Second, "a socket of the loop's own in place of the broken batch's", func() bool {
		now, _, err := fsid.Stat(ds[1].SocketPath)
		return err == nil && now != other
	})
	for _, d := range ds[1:] {
		awaitSocket(t, d)
		registerAndWait(t, in.sup, d)
	}
	if mustID(t, ds[0].SocketPath) != kept || statusOf(in.sup, ds[0].Name).Attempts != 0 {
		t.Errorf("%s: registered again", ds[0].Name)
	}
}

// rawMsg is a message a fake holder sends, with its descriptors; answer: it reads the new
// instance's answer before it goes on.
type rawMsg struct {
	m      *handover.Msg
	files  []*os.File
	answer bool
}

// fakeHolderSays makes a holder of reg that reads one request's hello and sends msgs, in order.
// The channel gives the types of the new instance's answers once the last one is read.
func fakeHolderSays(t *testing.T, reg string, lock *os.File, msgs ...rawMsg) <-chan []string {
	t.Helper()
	l, err := handover.Listen(reg)
	if err != nil {
		t.Fatal(err)
	}
	answers := make(chan []string, 1)
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		var got []string
		defer func() { answers <- got }()
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 4096)
		if _, _, _, _, err := c.ReadMsgUnix(buf, nil); err != nil { // the hello
			return
		}
		// answer reads one answer of the new instance; false once it has gone.
		answer := func() bool {
			n, _, _, _, err := c.ReadMsgUnix(buf, nil)
			if errors.Is(err, syscall.ECONNRESET) { // it closed with messages unread: what it said is read next
				n, _, _, _, err = c.ReadMsgUnix(buf, nil)
			}
			if err != nil || n == 0 {
				return false
			}
			var m handover.Msg
			json.Unmarshal(buf[:n], &m)
			got = append(got, m.Type)
			return true
		}
		for _, r := range msgs {
			b, err := json.Marshal(r.m)
			if err != nil {
				return
			}
			var fds []int
			for _, f := range r.files {
				fds = append(fds, int(f.Fd()))
			}
			var oob []byte
			if len(fds) > 0 {
				oob = syscall.UnixRights(fds...)
			}
			if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
				answer() // the new instance gave up, and closed: what it said last, if anything
				return
			}
			if r.answer && !answer() {
				return
			}
		}
	}()
	return answers
}

// floodDrivers are n drivers a predecessor hands over that no test configures, each with a
// listening registration socket in reg (their descriptors returned, in order) when sockets is
// set, recorded as multireg's own (regdir.OwnedName) as a predecessor records its sockets.
func floodDrivers(t *testing.T, reg string, n int, sockets bool) ([]*handover.Driver, []*os.File) {
	t.Helper()
	var ds []*handover.Driver
	var files []*os.File
	var names []string
	for i := range n {
		d := testDriver(filepath.Dir(reg), fmt.Sprintf("flood-%d.example.com", i), config.DRAPlugin, filepath.Join(reg, "..", "ep", fmt.Sprintf("flood-%d.sock", i)))
		hd := &handover.Driver{Spec: d, Endpoint: d.Endpoint, Status: handedStatus(DriverStatus{Phase: WaitingForEndpoint, LastError: "endpoint not ready"})}
		if sockets {
			l, err := testkit.ListenUnlinked(d.SocketPath)
			if err != nil {
				t.Fatal(err)
			}
			f, err := l.File()
			l.Close() // f keeps it listening
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			files = append(files, f)
			names = append(names, d.SocketName)
			hd.Sockets = []*handover.Socket{{Path: d.SocketPath, ID: mustID(t, d.SocketPath), Generation: 1, Registered: true, Endpoint: d.Endpoint}}
		}
		ds = append(ds, hd)
	}
	record := "# Registration sockets owned by multireg; it removes those no longer configured.\n" + strings.Join(names, "\n") + "\n"
	if err := os.WriteFile(filepath.Join(reg, regdir.OwnedName), []byte(record), 0o600); err != nil {
		t.Fatal(err)
	}
	return ds, files
}

// inBatches is the hand-over, in version 2, of drivers (files, their sockets' descriptors in
// order) in batches of 64, the lock with the last one, as a fake holder sends it (fakeHolderSays).
func inBatches(drivers []*handover.Driver, files []*os.File, lock *os.File) []rawMsg {
	msgs := []rawMsg{{m: &handover.Msg{Type: handover.MsgWelcome, Version: 2}, answer: true}}
	for i := 0; i == 0 || i < len(drivers); i += 64 {
		batch := drivers[i:min(i+64, len(drivers))]
		r := rawMsg{m: &handover.Msg{Type: handover.MsgBatch, Version: 2, Drivers: batch}}
		for _, hd := range batch {
			r.files = append(r.files, files[:len(hd.Sockets)]...)
			files = files[len(hd.Sockets):]
		}
		r.m.Sockets = len(r.files)
		if i+64 >= len(drivers) {
			r.m.Last, r.m.Lock, r.answer = true, true, true
			r.files = append(r.files, lock)
		}
		msgs = append(msgs, r)
	}
	return msgs
}

// heldLock is reg's lock file, locked as a holder holds it.
func heldLock(t *testing.T, reg string) *os.File {
	t.Helper()
	if err := os.MkdirAll(reg, 0o750); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(reg, regdir.LockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Close() })
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	return lock
}

// TestHandOverBoundsWhatItAccepts: a predecessor that hands over far more drivers than the new
// instance configures (400 with a socket each, 5000 without) is refused as out of protocol
// once past the bound (256 drivers the new instance does not configure, or as many as it
// configures): it says abort, keeps no driver it does not configure but what it must withdraw,
// and logs a summary instead of a line per driver. Once the predecessor has ended, no socket of
// those drivers is left: those it kept are withdrawn, the others removed as the sockets of
// drivers no longer configured are (recorded, and nothing listens).
func TestHandOverBoundsWhatItAccepts(t *testing.T) {
	for _, tt := range []struct {
		name    string
		n       int
		sockets bool
		kept    int // most drivers the new instance may keep
	}{
		{"with sockets", 400, true, 256},
		{"without sockets", 5000, false, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			reg := filepath.Join(dir, "reg")
			ds := handoverDrivers(t, dir)
			lock := heldLock(t, reg)
			flood, files := floodDrivers(t, reg, tt.n, tt.sockets)
			answers := fakeHolderSays(t, reg, lock, inBatches(flood, files, lock)...)
			got := make(chan []string, 1)
			go func() { // the holder ends once it has the answer
				a := <-answers
				handover.CloseAll(files)
				lock.Close()
				got <- a
			}()
			var logs testkit.Buffer
			in := startMultiregLog(t, reg, ds, logs.Logger())
			if a := fmt.Sprint(<-got); a != "[take abort]" {
				t.Errorf("the new instance answered %s, want [take abort]", a)
			}
			if in.handed > tt.kept {
				t.Errorf("the new instance kept %d drivers it does not configure, want %d at most", in.handed, tt.kept)
			}
			testkit.Eventually(t, 10*time.Second, "no socket of the drivers handed over left", func() bool {
				for _, hd := range flood {
					if testkit.IsSocket(hd.Spec.SocketPath) {
						return false
					}
				}
				return true
			})
			for _, d := range ds {
				awaitSocket(t, d)
			}
			lines := 0
			for l := range strings.Lines(logs.String()) {
				if strings.Contains(l, "flood-") {
					lines++
				}
			}
			if lines > 2 {
				t.Errorf("%d log lines name a driver handed over, want a summary:\n%s", lines, logs.String())
			}
		})
	}
}

// TestHandOverRefusesADuplicateDriver: a predecessor that hands one driver over twice (the
// second time in its last batch, with another socket) is out of protocol: the new instance
// says abort, names the driver, and keeps the batch received whole before; once the
// predecessor has ended, it serves the first socket as it was.
func TestHandOverRefusesADuplicateDriver(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	ds := handoverDrivers(t, dir)
	lock := heldLock(t, reg)
	d := ds[0]
	id, f := handedSocket(t, d)
	first := handedRegistered(d, id, f).Take(d.Name)
	other, err := testkit.ListenUnlinked(filepath.Join(reg, "other-reg.sock"))
	if err != nil {
		t.Fatal(err)
	}
	otherFile, err := other.File()
	other.Close()
	if err != nil {
		t.Fatal(err)
	}
	second := handedRegistered(d, mustID(t, filepath.Join(reg, "other-reg.sock")), otherFile).Take(d.Name)
	second.Sockets[0].Path = filepath.Join(reg, "other-reg.sock")
	answers := fakeHolderSays(t, reg, lock,
		rawMsg{m: &handover.Msg{Type: handover.MsgWelcome, Version: 2}, answer: true},
		rawMsg{m: &handover.Msg{Type: handover.MsgBatch, Version: 2, Drivers: []*handover.Driver{first}, Sockets: 1}, files: []*os.File{f}},
		rawMsg{m: &handover.Msg{Type: handover.MsgBatch, Version: 2, Drivers: []*handover.Driver{second}, Sockets: 1, Last: true, Lock: true}, files: []*os.File{otherFile, lock}, answer: true},
	)
	got := make(chan []string, 1)
	go func() {
		a := <-answers
		f.Close()
		otherFile.Close()
		lock.Close()
		got <- a
	}()
	var logs testkit.Buffer
	in := startMultiregLog(t, reg, ds, logs.Logger())
	if a := fmt.Sprint(<-got); a != "[take abort]" {
		t.Errorf("the new instance answered %s, want [take abort]", a)
	}
	said := false
	for l := range strings.Lines(logs.String()) {
		said = said || strings.Contains(l, "handed over twice") && strings.Contains(l, d.Name)
	}
	if !said {
		t.Errorf("the log does not say that %s was handed over twice:\n%s", d.Name, logs.String())
	}
	if n := in.sup.TakenOver(); n != 1 || mustID(t, d.SocketPath) != id {
		t.Errorf("%d sockets taken over, want the first batch's", n)
	}
	if st := statusOf(in.sup, d.Name); st.Phase != Registered {
		t.Errorf("%s: %s, want Registered on the first socket handed over", d.Name, st.Phase)
	}
}

// TestHandOverSaysANonSocketOnce: a predecessor that hands a file that is not a socket for a
// driver's socket has it refused, and the log says why once ("socket operation on
// non-socket"), not once per option read.
func TestHandOverSaysANonSocketOnce(t *testing.T) {
	dir := testkit.ShortDir(t)
	d := handoverDrivers(t, dir)[1] // the device plugin
	id, f := handedSocket(t, d)
	defer f.Close()
	notSocket, err := os.CreateTemp(dir, "not-a-socket")
	if err != nil {
		t.Fatal(err)
	}
	var logs testkit.Buffer
	s := runSupervisor(t, Options{Log: logs.Logger()})
	s.TakeOver(handedRegistered(d, id, notSocket))
	s.Start(d)
	if n := s.TakenOver(); n != 0 {
		t.Fatalf("%d sockets taken over, want none", n)
	}
	line := ""
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "cannot be served") {
			line = l
		}
	}
	if n := strings.Count(line, "socket operation on non-socket"); n != 1 {
		t.Errorf("the log says %d times why the descriptor is refused, want once: %s", n, line)
	}
}

// TestHandOverRefusedPastTheBoundResumesTheHolder: a holder that hands over more drivers than
// the new instance accepts (400, none of which it configures) is refused midway: the new
// instance says abort and closes with batches unread, and the holder serves every driver again,
// still holding the directory, its log saying why the new instance gave up.
func TestHandOverRefusedPastTheBoundResumesTheHolder(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg := filepath.Join(dir, "reg")
	var ds []config.Driver
	for i := range 400 {
		ds = append(ds, testDriver(dir, fmt.Sprintf("held-%d.example.com", i), config.DRAPlugin, filepath.Join(dir, "ep", fmt.Sprintf("%d.sock", i))))
	}
	var logs testkit.Buffer
	a := startMultiregLog(t, reg, ds, logs.Logger())
	snap, lock, err := handover.Ask(reg, testkit.Logger(t), func(*os.File) error { return nil }, []string{"new.example.com"}, nil)
	snap.Close()
	if err == nil {
		lock.Close()
		t.Fatal("the hand-over of 400 drivers not configured was taken")
	}
	testkit.Eventually(t, 10*time.Second, "the holder to serve every driver again", func() bool { return len(a.sup.Status()) == len(ds) })
	testkit.Eventually(t, 10*time.Second, "the holder to log the hand-over's failure", func() bool { return strings.Contains(logs.String(), "hand-over failed") })
	if !strings.Contains(logs.String(), "the new instance gave up: more than 256 drivers") {
		t.Errorf("the holder's log does not say why the new instance gave up:\n%s", grepLines(logs.String(), "hand-over"))
	}
	if err := a.dir.Check(); err != nil {
		t.Errorf("the holder lost the directory: %v", err)
	}
	select {
	case err := <-a.ran:
		t.Errorf("the holder's Run returned %v", err)
	default:
	}
}

// grepLines is the lines of s that contain sub.
func grepLines(s, sub string) string {
	var b strings.Builder
	for l := range strings.Lines(s) {
		if strings.Contains(l, sub) {
			b.WriteString(l)
		}
	}
	return b.String()
}
