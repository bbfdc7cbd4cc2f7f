package handover

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"multireg.dev/multireg/config"

	"multireg.dev/multireg/internal/testkit"
)

// fakeHolder makes a holder of dir that accepts one hand-over request, reads its hello and
// leaves the rest to serve, on a goroutine the test waits for when it ends.
func fakeHolder(t *testing.T, dir string, serve func(Conn)) {
	t.Helper()
	l, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		hc := Conn{c: c}
		defer hc.Close()
		_, fs, err := hc.Recv()
		CloseAll(fs)
		if err == nil {
			serve(hc)
		}
	}()
}

// lie makes a holder of dir that answers one hand-over request with one batch of drivers,
// their descriptors files and the lock's, then released if the new instance acknowledges. The
// channel says the new instance's answer (ack or abort), once.
func lie(t *testing.T, dir string, drivers []*Driver, files []*os.File, lock *os.File) <-chan string {
	t.Helper()
	answer := make(chan string, 1)
	fakeHolder(t, dir, func(hc Conn) {
		m := &Msg{Type: MsgBatch, Version: 1, Drivers: drivers, Last: true, Lock: true, Sockets: len(files)}
		if err := hc.Send(m, append(files, lock)...); err != nil {
			return
		}
		reply, fs, err := hc.Recv()
		CloseAll(fs)
		if err != nil {
			answer <- err.Error()
			return
		}
		answer <- reply.Type
		if reply.Type == MsgAck {
			hc.Send(&Msg{Type: MsgReleased, Version: 1})
		}
	})
	return answer
}

// lockedFile opens dir's lock file (created if missing) and locks it, as a holder does.
func lockedFile(t *testing.T, dir string) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, ".multireg.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	return f
}

// sameLockFile is a new instance's check of the lock's descriptor: the file at dir's lock path.
func sameLockFile(dir string) func(*os.File) error {
	return func(f *os.File) error {
		a, err := f.Stat()
		if err != nil {
			return err
		}
		b, err := os.Stat(filepath.Join(dir, ".multireg.lock"))
		if err != nil {
			return err
		}
		if !os.SameFile(a, b) {
			return os.ErrInvalid
		}
		return nil
	}
}

// TestAskNeedsTheLockHeld: a lock descriptor that is the lock file but does
// not hold its lock (another open of it) is refused before the acknowledgement: the new
// instance would serve while nobody holds the directory. The holder's own open file, which
// holds it, is taken.
func TestAskNeedsTheLockHeld(t *testing.T) {
	dir := testkit.ShortDir(t)
	held := lockedFile(t, dir)
	unlocked, err := os.Open(filepath.Join(dir, ".multireg.lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer unlocked.Close()

	answer := lie(t, dir, nil, nil, unlocked)
	snap, lock, err := Ask(dir, testkit.Logger(t), sameLockFile(dir), nil, nil)
	if err == nil || lock != nil {
		lock.Close()
		t.Fatalf("Ask took an unlocked open of the lock file: err %v", err)
	}
	snap.Close()
	if a := <-answer; a != MsgAbort {
		t.Errorf("the new instance answered %q, want %q", a, MsgAbort)
	}

	answer = lie(t, dir, nil, nil, held)
	snap, lock, err = Ask(dir, testkit.Logger(t), sameLockFile(dir), nil, nil)
	if err != nil {
		t.Fatalf("Ask refused the holder's own lock: %v", err)
	}
	snap.Close()
	lock.Close()
	if a := <-answer; a != MsgAck {
		t.Errorf("the new instance answered %q, want %q", a, MsgAck)
	}
}

// TestWithdrawRemovesOnlyWhatWasHanded: the sockets of handed drivers no loop
// takes are removed only when they are registration sockets of the directory held and the
// handed descriptor is the socket bound there: a predecessor that names another process's
// socket, outside the directory or in it, has it left alone.
func TestWithdrawRemovesOnlyWhatWasHanded(t *testing.T) {
	dir := testkit.ShortDir(t)
	reg, other := filepath.Join(dir, "reg"), filepath.Join(dir, "other")
	for _, d := range []string{reg, other} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	listen := func(path string) *net.UnixListener {
		l, err := testkit.ListenUnlinked(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		return l
	}
	outside := listen(filepath.Join(other, "victim.sock")) // another process's socket
	plugin := filepath.Join(reg, "third-party-reg.sock")   // a plugin registering itself
	listen(plugin)                                         //
	mine := listen(filepath.Join(reg, "retired-reg.sock")) // really handed over
	spare := listen(filepath.Join(other, "spare.sock"))    // a descriptor to lie with
	hand := func(l *net.UnixListener, path string) *Socket { return handedSocket(t, l, path) }
	sockets := []*Socket{
		hand(outside, filepath.Join(other, "victim.sock")),
		hand(spare, plugin),
		hand(mine, filepath.Join(reg, "retired-reg.sock")),
	}
	var files []*os.File
	var ds []*Driver
	for i, hs := range sockets {
		files = append(files, hs.File)
		ds = append(ds, &Driver{Spec: config.Driver{Registration: config.Registration{Name: fmt.Sprintf("gone-%d.example.com", i)}}, Sockets: []*Socket{hs}})
	}
	answer := lie(t, reg, ds, files, lockedFile(t, reg))
	snap, lock, err := Ask(reg, testkit.Logger(t), sameLockFile(reg), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if a := <-answer; a != MsgAck {
		t.Fatalf("the new instance answered %q", a)
	}
	for _, hd := range snap.TakeAll() {
		hd.Withdraw(testkit.Logger(t))
	}
	for _, p := range []string{filepath.Join(other, "victim.sock"), plugin} {
		if !testkit.IsSocket(p) {
			t.Errorf("%s removed: it was not a socket handed over in the registration directory", p)
		}
	}
	if p := filepath.Join(reg, "retired-reg.sock"); testkit.IsSocket(p) {
		t.Errorf("%s kept: it was handed over, and no driver takes it", p)
	}
}

// holderSays makes a holder of dir that reads one request's hello, then sends msgs, in
// order (the lock's descriptor with a message that says Lock), reading the answer to each
// welcome before it goes on, and then what else the new instance answers; the channel gives
// the types of its answers once it has closed the connection.
func holderSays(t *testing.T, dir string, lock *os.File, msgs ...*Msg) <-chan []string {
	t.Helper()
	answers := make(chan []string, 1)
	fakeHolder(t, dir, func(hc Conn) {
		var got []string
		defer func() { answers <- got }()
		// recv reads one answer; false once the new instance has gone.
		recv := func() bool {
			m, fs, err := hc.Recv()
			CloseAll(fs)
			if err == nil {
				got = append(got, m.Type)
			}
			return err == nil
		}
		for _, m := range msgs {
			var files []*os.File
			if m.Lock {
				files = append(files, lock)
			}
			// After a welcome its answer is read before anything else is sent: a new instance
			// that gives up closes with what it has not read, which makes its answers unreadable.
			if hc.Send(m, files...) != nil || m.Type == MsgWelcome && !recv() {
				return
			}
		}
		for recv() {
		}
	})
	return answers
}

// TestAskRefusesAHolderOutOfProtocol: a holder that welcomes in a version the new instance
// does not speak, or below the one that has a welcome, welcomes twice, or sends batches in
// another version than it welcomed in (or in version 2 without a welcome), hands nothing
// over: the new instance never acknowledges, never says take after a welcome it cannot
// accept, says abort, and holds no lock.
func TestAskRefusesAHolderOutOfProtocol(t *testing.T) {
	last := func(v int) *Msg { return &Msg{Type: MsgBatch, Version: v, Last: true, Lock: true} }
	welcome := func(v int) *Msg { return &Msg{Type: MsgWelcome, Version: v} }
	for _, tt := range []struct {
		name string
		msgs []*Msg
		want string // what the new instance answers
	}{
		{"a welcome in version 3", []*Msg{welcome(3), last(3)}, "[abort]"},
		{"a welcome in version 1", []*Msg{welcome(1), last(1)}, "[abort]"},
		{"two welcomes", []*Msg{welcome(2), welcome(2), last(2)}, "[take abort]"},
		{"a batch in version 1 after a welcome in 2", []*Msg{welcome(2), last(1)}, "[take abort]"},
		{"a batch in version 2 without a welcome", []*Msg{last(2)}, "[abort]"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			answers := holderSays(t, dir, lockedFile(t, dir), tt.msgs...)
			snap, lock, err := Ask(dir, testkit.Logger(t), sameLockFile(dir), nil, nil)
			snap.Close()
			if err == nil || lock != nil {
				lock.Close()
				t.Fatalf("Ask took the hand-over: err %v", err)
			}
			if got := fmt.Sprint(<-answers); got != tt.want {
				t.Errorf("the new instance answered %s, want %s", got, tt.want)
			}
		})
	}
}

// TestAskKeepsWhatCameBeforeAProtocolError: a holder whose last batch breaks the protocol
// (another version than the one it welcomed in, after a valid first batch) hands nothing
// over, and costs only that batch's drivers: the new instance says abort, and keeps the
// sockets of the first batch, each still the socket bound at its path, to serve once it holds
// the directory.
func TestAskKeepsWhatCameBeforeAProtocolError(t *testing.T) {
	dir := testkit.ShortDir(t)
	lock := lockedFile(t, dir)
	socket := func(name string) (*Driver, *os.File) {
		path := filepath.Join(dir, name+"-reg.sock")
		l, err := testkit.ListenUnlinked(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		hs := handedSocket(t, l, path)
		return &Driver{Spec: config.Driver{Registration: config.Registration{Name: name}}, Sockets: []*Socket{hs}}, hs.File
	}
	first, firstFile := socket("first.example.com")
	second, secondFile := socket("second.example.com")
	answers := make(chan []string, 1)
	fakeHolder(t, dir, func(hc Conn) {
		var got []string
		defer func() { answers <- got }()
		if hc.Send(&Msg{Type: MsgWelcome, Version: 2}) != nil {
			return
		}
		for {
			m, fs, err := hc.Recv()
			CloseAll(fs)
			if err != nil {
				return
			}
			got = append(got, m.Type)
			if m.Type != MsgTake {
				continue
			}
			hc.Send(&Msg{Type: MsgBatch, Version: 2, Drivers: []*Driver{first}, Sockets: 1}, firstFile)
			hc.Send(&Msg{Type: MsgBatch, Version: 1, Drivers: []*Driver{second}, Sockets: 1, Last: true, Lock: true}, secondFile, lock)
		}
	})
	snap, got, err := Ask(dir, testkit.Logger(t), sameLockFile(dir), nil, nil)
	if err == nil || got != nil {
		got.Close()
		t.Fatalf("Ask took a hand-over whose last batch is in another version: err %v", err)
	}
	t.Logf("Ask: %v", err)
	defer snap.Close()
	if a := fmt.Sprint(<-answers); a != "[take abort]" {
		t.Errorf("the new instance answered %s, want [take abort]", a)
	}
	if snap.Len() != 1 || snap.Sockets() != 1 {
		t.Fatalf("kept %d drivers and %d sockets, want the first batch's: 1 and 1", snap.Len(), snap.Sockets())
	}
	hd := snap.Take("first.example.com")
	if hd == nil {
		t.Fatal("the first batch's driver is not kept")
	}
	defer hd.Close()
	if err := hd.Sockets[0].Check(); err != nil {
		t.Errorf("the first batch's socket, kept: %v", err)
	}
}

// TestAskRefusesADriverHandedOverTwice: a holder that hands one driver over twice, in one batch
// or in two, is out of protocol: the new instance says abort, names the driver, and keeps only
// the batches received whole before the one that repeats it. The second part never replaces the
// first.
func TestAskRefusesADriverHandedOverTwice(t *testing.T) {
	for _, tt := range []struct {
		name    string
		batches [][]string // the sockets' names of each batch, by driver: "<driver>/<socket>"
		kept    []string   // the sockets kept
	}{
		{"in one batch", [][]string{{"a/a1", "a/a2"}}, nil},
		{"in two batches", [][]string{{"a/a1", "b/b1"}, {"a/a2"}}, []string{"a1", "b1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := testkit.ShortDir(t)
			lock := lockedFile(t, dir)
			var msgs []*Msg
			var files [][]*os.File
			for i, batch := range tt.batches {
				m := &Msg{Type: MsgBatch, Version: 1, Last: i == len(tt.batches)-1, Lock: i == len(tt.batches)-1}
				var fs []*os.File
				for _, ds := range batch {
					driver, sock, _ := strings.Cut(ds, "/")
					path := filepath.Join(dir, sock+"-reg.sock")
					l, err := testkit.ListenUnlinked(path)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { l.Close() })
					hs := handedSocket(t, l, path)
					m.Drivers = append(m.Drivers, &Driver{Spec: config.Driver{Registration: config.Registration{Name: driver + ".example.com"}}, Sockets: []*Socket{hs}})
					fs = append(fs, hs.File)
				}
				m.Sockets = len(fs)
				msgs, files = append(msgs, m), append(files, fs)
			}
			answers := make(chan []string, 1)
			fakeHolder(t, dir, func(hc Conn) {
				var got []string
				defer func() { answers <- got }()
				for i, m := range msgs {
					fs := files[i]
					if m.Lock {
						fs = append(fs, lock)
					}
					if hc.Send(m, fs...) != nil {
						break
					}
				}
				for {
					m, fs, err := hc.Recv()
					CloseAll(fs)
					if err != nil {
						return
					}
					got = append(got, m.Type)
				}
			})
			snap, got, err := Ask(dir, testkit.Logger(t), sameLockFile(dir), nil, nil)
			defer snap.Close()
			if err == nil || got != nil {
				got.Close()
				t.Fatalf("Ask took a hand-over that repeats a driver: err %v", err)
			}
			if !strings.Contains(err.Error(), `"a.example.com" handed over twice`) {
				t.Errorf("Ask: %v, want the driver named", err)
			}
			if a := fmt.Sprint(<-answers); a != "[abort]" {
				t.Errorf("the new instance answered %s, want [abort]", a)
			}
			var kept []string
			for _, hd := range snap.TakeAll() {
				for _, hs := range hd.Sockets {
					if err := hs.Check(); err != nil {
						t.Errorf("%s: %v", hs.Path, err)
					}
					kept = append(kept, strings.TrimSuffix(filepath.Base(hs.Path), "-reg.sock"))
				}
				hd.Close()
			}
			slices.Sort(kept)
			if !slices.Equal(kept, tt.kept) {
				t.Errorf("kept the sockets %q, want %q", kept, tt.kept)
			}
		})
	}
}

// TestWithdrawSumsUpMany: the sockets of drivers no loop took over are withdrawn with a line for
// each driver when they are few, and one line for all when they are many, which counts the
// sockets removed and those left alone (a socket replaced since it was handed over), and says
// why the first was.
func TestWithdrawSumsUpMany(t *testing.T) {
	for _, n := range []int{perDriverLines, perDriverLines + 1, 300} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			dir := testkit.ShortDir(t)
			snap := &Snapshot{}
			var paths []string
			for i := range n {
				name := fmt.Sprintf("gone-%d.example.com", i)
				hs := listening(t, dir, name)
				snap.Add(&Driver{Spec: config.Driver{Registration: config.Registration{Name: name}}, Sockets: []*Socket{hs}})
				paths = append(paths, hs.Path)
			}
			// The last one's socket is replaced meanwhile: it is left alone.
			replaced := paths[n-1]
			if err := os.Remove(replaced); err != nil {
				t.Fatal(err)
			}
			listening(t, dir, fmt.Sprintf("gone-%d.example.com", n-1))
			var logs testkit.Buffer
			snap.Withdraw(logs.Logger())
			if snap.Len() != 0 || snap.Sockets() != 0 {
				t.Errorf("%d drivers and %d sockets left in the snapshot", snap.Len(), snap.Sockets())
			}
			for _, p := range paths[:n-1] {
				if testkit.IsSocket(p) {
					t.Errorf("%s kept", p)
				}
			}
			if !testkit.IsSocket(replaced) {
				t.Errorf("%s, replaced since it was handed over, removed", replaced)
			}
			lines := strings.Count(logs.String(), "\n")
			switch {
			case n <= perDriverLines && lines != n:
				t.Errorf("%d drivers: %d log lines, want one for each:\n%s", n, lines, logs.String())
			case n > perDriverLines && lines != 1:
				t.Errorf("%d drivers: %d log lines, want one for all:\n%s", n, lines, logs.String())
			case n > perDriverLines:
				for _, want := range []string{fmt.Sprintf("drivers=%d ", n), fmt.Sprintf("removed=%d ", n-1), "leftAlone=1 ", "notRemoved=0 ", replaced} {
					if !strings.Contains(logs.String(), want) {
						t.Errorf("the line lacks %q: %s", want, logs.String())
					}
				}
			}
		})
	}
}

// listenersHolder makes a holder of reg that hands over, in version 2, a last batch of no
// driver with the listeners specs, their descriptors and the lock's (files), and sends on the
// channel it returns the listeners the new instance's acknowledgement names (closed without
// one).
func listenersHolder(t *testing.T, reg string, specs []ListenerSpec, files ...*os.File) <-chan []ListenerSpec {
	acked := make(chan []ListenerSpec, 1)
	fakeHolder(t, reg, func(hc Conn) { // the hello read
		hc.Send(&Msg{Type: MsgWelcome, Version: 2})
		if _, fs, err := hc.Recv(); err != nil { // take
			return
		} else {
			CloseAll(fs)
		}
		hc.Send(&Msg{Type: MsgBatch, Version: 2, Last: true, Lock: true, Listeners: specs}, files...)
		m, fs, err := hc.Recv()
		if err != nil || m.Type != MsgAck {
			close(acked)
			return
		}
		CloseAll(fs)
		acked <- m.Listeners
		hc.Send(&Msg{Type: MsgReleased, Version: 2})
	})
	return acked
}

// TestListenersHandedOver: version 2's last batch carries the process's listening sockets
// after the registration sockets; the new instance keeps those it serves (by name and
// address) that are listening TCP sockets (a unix socket among them is closed and left out),
// leaves out one it does not serve, and its acknowledgement names only those it kept: the
// holder serves them no more. A Merge into what it kept keeps them.
func TestListenersHandedOver(t *testing.T) {
	reg := testkit.ShortDir(t)
	tcpListener := func() (net.Listener, *os.File) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		f, err := l.(*net.TCPListener).File()
		if err != nil {
			t.Fatal(err)
		}
		return l, f
	}
	tcp, tf := tcpListener()
	other, of := tcpListener()
	unixL, err := testkit.ListenUnlinked(filepath.Join(reg, "not-tcp.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer unixL.Close()
	uf, err := unixL.File()
	if err != nil {
		t.Fatal(err)
	}
	lock := lockedFile(t, reg)
	good := ListenerSpec{Name: "health-http", Addr: tcp.Addr().String()}
	bad := ListenerSpec{Name: "health-grpc", Addr: "127.0.0.1:1"}
	unwanted := ListenerSpec{Name: "http", Addr: other.Addr().String()}
	acked := listenersHolder(t, reg, []ListenerSpec{good, bad, unwanted}, tf, uf, of, lock)
	got, lockF, err := Ask(reg, testkit.Logger(t), sameLockFile(reg), nil, []ListenerSpec{good, bad})
	if err != nil {
		t.Fatal(err)
	}
	defer lockF.Close()
	if a, ok := <-acked; !ok || !slices.Equal(a, []ListenerSpec{good}) {
		t.Errorf("the acknowledgement names %v (received: %v), want only %v", a, ok, good)
	}
	kept := &Snapshot{}
	kept.Merge(got)
	if fs := kept.TakeListeners(bad); len(fs) != 0 {
		t.Errorf("the unix socket handed over as a listener was kept")
	}
	if fs := kept.TakeListeners(unwanted); len(fs) != 0 {
		CloseAll(fs)
		t.Errorf("a listener this instance does not serve was kept")
	}
	fs := kept.TakeListeners(good)
	if len(fs) != 1 {
		t.Fatalf("%d listeners of %v kept, want 1", len(fs), good)
	}
	defer fs[0].Close()
	l, err := net.FileListener(fs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.Addr().String() != tcp.Addr().String() {
		t.Errorf("the listener kept listens on %s, want %s", l.Addr(), tcp.Addr())
	}
}

// TestListenerOfAnotherNetns: a listening socket of another network namespace (another pod's
// network, where the same address is another socket) is not taken, whatever its name and
// address, and the acknowledgement does not name it: its instance goes on serving it.
func TestListenerOfAnotherNetns(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a network namespace")
	}
	l, err := listenInNewNetns()
	if errors.Is(err, unix.EPERM) {
		t.Skipf("root, but no network namespace here (a container without CAP_SYS_ADMIN): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	f, err := l.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	if err := inNetns(f); err == nil {
		t.Fatalf("inNetns: a listener of another network namespace found in this one")
	}
	// The same check passes a listener of this namespace.
	here, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer here.Close()
	hf, err := here.(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer hf.Close()
	if err := inNetns(hf); err != nil {
		t.Fatalf("inNetns: a listener of this namespace: %v", err)
	}

	reg := testkit.ShortDir(t)
	lock := lockedFile(t, reg)
	spec := ListenerSpec{Name: "health-http", Addr: l.Addr().String()}
	acked := listenersHolder(t, reg, []ListenerSpec{spec}, f, lock)
	var logs testkit.Buffer
	got, lockF, err := Ask(reg, logs.Logger(), sameLockFile(reg), nil, []ListenerSpec{spec})
	if err != nil {
		t.Fatal(err)
	}
	defer lockF.Close()
	defer got.Close()
	if a, ok := <-acked; !ok || len(a) != 0 {
		t.Errorf("the acknowledgement names %v (received: %v), want none", a, ok)
	}
	if fs := got.TakeListeners(spec); len(fs) != 0 {
		CloseAll(fs)
		t.Errorf("a listener of another network namespace was taken")
	}
	if !strings.Contains(logs.String(), "level=INFO msg=\"a listener handed over is of another network namespace") {
		t.Errorf("the log does not say why the listener was left: %s", logs.String())
	}
}

// listenInNewNetns listens on 127.0.0.1 in a network namespace of its own, made on a locked
// thread that goes back to its namespace after (the socket stays in the new one).
func listenInNewNetns() (net.Listener, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, err
	}
	defer orig.Close()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("unshare: %w", err)
	}
	l, err := listenOnNewLoopback()
	if serr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); serr != nil {
		// The thread stays in the new namespace: lock it for good, so that the runtime
		// ends it with this goroutine rather than run another goroutine on it.
		runtime.LockOSThread()
		panic(fmt.Sprintf("setns back: %v", serr))
	}
	return l, err
}

// listenOnNewLoopback brings up the loopback of a new network namespace (down there) and
// listens on it.
func listenOnNewLoopback() (net.Listener, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return nil, err
	}
	ifr.SetUint16(unix.IFF_UP | unix.IFF_LOOPBACK | unix.IFF_RUNNING)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return nil, fmt.Errorf("lo up: %w", err)
	}
	return net.Listen("tcp", "127.0.0.1:0")
}
