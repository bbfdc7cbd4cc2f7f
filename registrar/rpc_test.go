package registrar

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	_ "google.golang.org/grpc/encoding/gzip" // registers the compressor a test calls with
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"multireg.dev/multireg/internal/testkit"
)

// The registration sockets are served by rpcConn, not by gRPC's server; gRPC's client, as
// kubelet uses it, is the other end of these tests, and a client writing frames by hand plays
// the broken and hostile ones.

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: %v, want %s", what, err, want)
	}
}

// TestRPCAnswersWhatGRPCsClientAsks: what gRPC's client may do beyond kubelet's two calls is
// answered as gRPC's server would, and the connection goes on serving.
func TestRPCAnswersWhatGRPCsClientAsks(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	k := dialKubelet(t, g.path)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	err := k.conn.Invoke(ctx, "/pluginregistration.Registration/Nope", &registerapi.InfoRequest{}, &registerapi.PluginInfo{})
	wantCode(t, "an unknown method", err, codes.Unimplemented)

	_, err = k.c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: "compressed"}, grpc.UseCompressor("gzip"))
	wantCode(t, "a compressed request", err, codes.Unimplemented)

	_, err = k.c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: strings.Repeat("x", maxRequest+1)})
	wantCode(t, "a request over the bound", err, codes.ResourceExhausted)

	// More calls at once than a connection's streams: gRPC's client waits for a stream.
	var wg sync.WaitGroup
	errs := make(chan error, 4*maxCallStreams)
	for range 4 * maxCallStreams {
		wg.Go(func() {
			_, err := k.c.GetInfo(ctx, &registerapi.InfoRequest{})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("GetInfo among %d at once: %v", 4*maxCallStreams, err)
		}
	}

	// Replies that add up to many times the client's first window: it gives it back as it
	// reads, and the server counts it.
	var sent int
	for sent < 4*initialWindow {
		info := k.getInfo(t)
		if info.Name != g.rs.info.Name {
			t.Fatalf("GetInfo answered %q", info.Name)
		}
		sent += len(g.rs.infoMsg) + 5
	}
	k.notify(t, true, "")
}

// TestRPCStopAnswersTheVerdictThatStoppedIt: the loop stops a generation on kubelet's verdict,
// while the verdict's call is still being answered: the reply reaches kubelet (it would log
// a failure otherwise), and stop then returns.
func TestRPCStopAnswersTheVerdictThatStoppedIt(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	stopped := make(chan struct{})
	g.rs.notify = func(verdict) {
		go func() {
			defer close(stopped)
			g.stop()
		}()
		testkit.Eventually(t, 5*time.Second, "stop under way", func() bool {
			g.mu.Lock()
			defer g.mu.Unlock()
			return g.stopped
		})
	}
	k := dialKubelet(t, g.path)
	k.getInfo(t)
	k.notify(t, false, "no")
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
}

// rawClient writes and reads HTTP/2 frames on a registration socket by hand.
type rawClient struct {
	t   *testing.T
	c   net.Conn
	fr  *http2.Framer
	hdr bytes.Buffer
	enc *hpack.Encoder
}

// dialRaw connects to path and, unless preface is false, does the client's part of the
// handshake: its preface and SETTINGS, and the ack of the server's.
func dialRaw(t *testing.T, path string, preface bool) *rawClient {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r := &rawClient{t: t, c: c, fr: http2.NewFramer(c, c)}
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	r.enc = hpack.NewEncoder(&r.hdr)
	if !preface {
		return r
	}
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := r.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	s, ok := r.next().(*http2.SettingsFrame)
	if !ok || s.IsAck() {
		t.Fatalf("the server's first frame is %v, want its SETTINGS", s)
	}
	if v, _ := s.Value(http2.SettingMaxConcurrentStreams); v != maxCallStreams {
		t.Errorf("the server allows %d streams, want %d", v, maxCallStreams)
	}
	if err := r.fr.WriteSettingsAck(); err != nil {
		t.Fatal(err)
	}
	return r
}

// next reads the next frame, but a SETTINGS ack and WINDOW_UPDATEs; nil when the connection
// closed.
func (r *rawClient) next() http2.Frame {
	r.t.Helper()
	_ = r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := r.fr.ReadFrame()
		if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil
		}
		if err != nil {
			r.t.Fatalf("reading the server's frames: %v", err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if f.IsAck() {
				continue
			}
		case *http2.WindowUpdateFrame:
			continue
		}
		return f
	}
}

// headers writes a request's headers on stream id.
func (r *rawClient) headers(id uint32, end bool, fields ...string) {
	r.t.Helper()
	r.hdr.Reset()
	for i := 0; i < len(fields); i += 2 {
		_ = r.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	block := r.hdr.Bytes()
	const frame = 16384 // the server's SETTINGS_MAX_FRAME_SIZE, the default
	first := block[:min(len(block), frame)]
	block = block[len(first):]
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: first, EndStream: end, EndHeaders: len(block) == 0}); err != nil {
		r.t.Fatal(err)
	}
	for len(block) > 0 {
		next := block[:min(len(block), frame)]
		block = block[len(next):]
		if err := r.fr.WriteContinuation(id, len(block) == 0, next); err != nil {
			r.t.Fatal(err)
		}
	}
}

// open writes the headers of a gRPC call of method on stream id, and fields after them.
func (r *rawClient) open(id uint32, end bool, method string, fields ...string) {
	r.t.Helper()
	r.headers(id, end, append([]string{":method", "POST", ":scheme", "http", ":path", method, ":authority", "localhost",
		"content-type", "application/grpc", "te", "trailers"}, fields...)...)
}

// call writes a request for method on stream id, its message framed as body.
func (r *rawClient) call(id uint32, method string, body []byte, fields ...string) {
	r.t.Helper()
	r.open(id, false, method, fields...)
	if err := r.fr.WriteData(id, true, body); err != nil {
		r.t.Fatal(err)
	}
}

// status reads the frames of stream id up to its end, and returns its grpc-status and
// grpc-message.
func (r *rawClient) status(id uint32) (string, string) {
	r.t.Helper()
	for {
		switch f := r.next().(type) {
		case nil:
			r.t.Fatalf("the connection closed before stream %d ended", id)
		case *http2.MetaHeadersFrame:
			if f.StreamID == id && f.StreamEnded() {
				var code, msg string
				for _, hf := range f.Fields {
					switch hf.Name {
					case "grpc-status":
						code = hf.Value
					case "grpc-message":
						msg = hf.Value
					}
				}
				return code, msg
			}
		case *http2.GoAwayFrame:
			r.t.Fatalf("GOAWAY %v before stream %d ended: %s", f.ErrCode, id, f.DebugData())
		}
	}
}

// goAway reads frames up to the server's GOAWAY and returns its code; the connection must
// close after it.
func (r *rawClient) goAway() http2.ErrCode {
	r.t.Helper()
	for {
		switch f := r.next().(type) {
		case nil:
			r.t.Fatal("the connection closed without a GOAWAY")
		case *http2.GoAwayFrame:
			code := f.ErrCode
			if f := r.next(); f != nil {
				r.t.Errorf("a frame after GOAWAY: %v", f)
			}
			return code
		}
	}
}

// framed is msg with gRPC's framing.
func framed(msg []byte) []byte {
	b := make([]byte, 5, 5+len(msg))
	binary.BigEndian.PutUint32(b[1:], uint32(len(msg)))
	return append(b, msg...)
}

// TestRPCRefusesBrokenAndHostileClients: a client that breaks the protocol gets an answer
// naming what it did, on its stream or connection, and the socket goes on serving kubelet.
func TestRPCRefusesBrokenAndHostileClients(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	stillServes := func(t *testing.T) {
		t.Helper()
		if info := register(t, g.path, true, ""); info.Name != g.rs.info.Name {
			t.Errorf("GetInfo answered %q", info.Name)
		}
	}
	const getInfo = registerapi.Registration_GetInfo_FullMethodName

	t.Run("not HTTP/2", func(t *testing.T) {
		r := dialRaw(t, g.path, false)
		_, _ = io.WriteString(r.c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		if code := r.goAway(); code != http2.ErrCodeProtocol {
			t.Errorf("GOAWAY %v, want PROTOCOL_ERROR", code)
		}
		stillServes(t)
	})
	t.Run("calls on one connection", func(t *testing.T) {
		r := dialRaw(t, g.path, true)
		if err := r.fr.WritePing(false, [8]byte{1, 2, 3}); err != nil {
			t.Fatal(err)
		}
		if p, ok := r.next().(*http2.PingFrame); !ok || !p.IsAck() || p.Data != [8]byte{1, 2, 3} {
			t.Errorf("PING answered with %v, want its ack", p)
		}
		r.call(1, getInfo, []byte{0, 0, 0, 0, 9})
		if code, msg := r.status(1); code != "13" || !strings.Contains(msg, "framing says 9") {
			t.Errorf("a misframed request: %s %q, want 13 (Internal) naming the length", code, msg)
		}
		r.headers(5, false, ":method", "POST", ":scheme", "http", ":path", getInfo, ":authority", "x", "content-type", "text/plain")
		if code, msg := r.status(5); code != "12" || !strings.Contains(msg, "text/plain") {
			t.Errorf("a request that is not gRPC: %s %q, want 12 (Unimplemented) naming its content-type", code, msg)
		}
		r.open(7, false, getInfo, "x-big", strings.Repeat("b", maxHeaderList))
		if code, _ := r.status(7); code != "8" {
			t.Errorf("headers over the bound: %s, want 8 (ResourceExhausted)", code)
		}
		r.call(9, getInfo, framed(nil), "Upper-Case", "is not HTTP/2's")
		for {
			f := r.next()
			if rst, ok := f.(*http2.RSTStreamFrame); ok && rst.StreamID == 7 {
				continue // the end of stream 7's request is not wanted
			}
			if rst, ok := f.(*http2.RSTStreamFrame); !ok || rst.StreamID != 9 || rst.ErrCode != http2.ErrCodeProtocol {
				t.Errorf("a header field name in upper case: %v, want RST_STREAM PROTOCOL_ERROR on its stream", f)
			}
			break
		}
		r.call(11, getInfo, framed(nil))
		if code, _ := r.status(11); code != "0" {
			t.Errorf("GetInfo after them: %s, want 0", code)
		}
	})
	t.Run("data on a stream never opened", func(t *testing.T) {
		r := dialRaw(t, g.path, true)
		if err := r.fr.WriteData(11, true, framed(nil)); err != nil {
			t.Fatal(err)
		}
		if code := r.goAway(); code != http2.ErrCodeProtocol {
			t.Errorf("GOAWAY %v, want PROTOCOL_ERROR", code)
		}
		stillServes(t)
	})
	t.Run("a stream number of the server's", func(t *testing.T) {
		r := dialRaw(t, g.path, true)
		r.open(2, true, getInfo)
		if code := r.goAway(); code != http2.ErrCodeProtocol {
			t.Errorf("GOAWAY %v, want PROTOCOL_ERROR", code)
		}
		stillServes(t)
	})
}

// TestRPCStopEndsIdleConnections: stop ends a connection kubelet holds between GetInfo and
// its verdict, and one that never sent its preface: it interrupts their reads, and each says
// GOAWAY before it closes (a connection closed by stop's last resort would not).
func TestRPCStopEndsIdleConnections(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	idle := dialRaw(t, g.path, true)
	idle.call(1, registerapi.Registration_GetInfo_FullMethodName, framed(nil))
	if code, _ := idle.status(1); code != "0" {
		t.Fatalf("GetInfo: %s", code)
	}
	mute := dialRaw(t, g.path, false)
	testkit.Eventually(t, 5*time.Second, "both connections served", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.conns) == 2
	})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.stop()
	}()
	if code := idle.goAway(); code != http2.ErrCodeNo {
		t.Errorf("GOAWAY %v, want NO_ERROR", code)
	}
	_ = mute.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := mute.c.Read(make([]byte, 64)); err == nil {
		// it may read the GOAWAY; the close follows
		_, err = io.ReadAll(mute.c)
		if err != nil {
			t.Errorf("the silent connection: %v, want it closed", err)
		}
	} else if !errors.Is(err, io.EOF) {
		t.Errorf("the silent connection: %v, want it closed", err)
	}
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not return")
	}
}

// TestRPCRefusesFramesOverTheDefaultSize: a client may send frames of 16384 bytes at most (the
// server advertises no other SETTINGS_MAX_FRAME_SIZE); a larger one ends the connection
// before its payload is read, instead of a buffer as large kept for the connection's life.
// The payload left unread may reset the connection before the client reads the GOAWAY: the
// log says why.
func TestRPCRefusesFramesOverTheDefaultSize(t *testing.T) {
	var log testkit.Buffer
	_, gs := serveTestLog(t, 1, log.Logger())
	r := dialRaw(t, gs[0].path, true)
	if err := r.fr.WriteRawFrame(0x42, 0, 0, make([]byte, maxFrame+1)); err != nil {
		t.Fatal(err)
	}
	_ = r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := r.fr.ReadFrame()
		if err != nil {
			if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
				t.Errorf("the connection: %v, want it closed", err)
			}
			break
		}
		if ga, ok := f.(*http2.GoAwayFrame); ok && ga.ErrCode != http2.ErrCodeFrameSize {
			t.Errorf("GOAWAY %v, want FRAME_SIZE_ERROR", ga.ErrCode)
		}
	}
	testkit.Eventually(t, 5*time.Second, "FRAME_SIZE_ERROR logged", func() bool {
		return strings.Contains(log.String(), "FRAME_SIZE_ERROR")
	})
}

// TestRPCBoundsWhatAConnectionHolds: requests left unfinished on a connection's streams may
// hold maxRequest in all, not maxRequest each: the call whose data goes over is refused, and
// the others stay.
func TestRPCBoundsWhatAConnectionHolds(t *testing.T) {
	_, gs := serveTest(t, 1)
	r := dialRaw(t, gs[0].path, true)
	const getInfo = registerapi.Registration_GetInfo_FullMethodName
	chunk := make([]byte, maxFrame)
	var over uint32
	for i := range uint32(maxCallStreams) {
		id := 2*i + 1
		r.open(id, false, getInfo)
		for range maxRequest / maxCallStreams / len(chunk) * 2 {
			if err := r.fr.WriteData(id, false, chunk); err != nil {
				t.Fatal(err)
			}
		}
		if i == maxCallStreams/2 {
			over = id
			break // the half of them, with twice their share
		}
	}
	code, msg := r.status(over)
	if code != "8" || !strings.Contains(msg, "open on the connection") {
		t.Errorf("the call that went over: %s %q, want 8 (ResourceExhausted) saying why", code, msg)
	}
	if err := r.fr.WriteData(1, true, nil); err != nil {
		t.Fatal(err)
	}
	if code, msg := r.status(1); code != "13" || !strings.Contains(msg, "framing") {
		t.Errorf("the first call, ended: %s %q, want 13 (Internal) about its framing: it was kept", code, msg)
	}
}

// TestRPCStopFinishesTheCallsBegun: a call whose headers were read when stop came is
// answered (its message arriving after), and GOAWAY then says no later stream was served; a
// stream opened meanwhile is refused, for gRPC's client to retry. Calls answered with a
// GOAWAY counting them but without their answer would be failed, not retried, by gRPC's client:
// kubelet deregisters a plugin whose verdict call fails.
func TestRPCStopFinishesTheCallsBegun(t *testing.T) {
	_, gs := serveTest(t, 1)
	g := gs[0]
	r := dialRaw(t, g.path, true)
	const getInfo = registerapi.Registration_GetInfo_FullMethodName
	r.open(1, false, getInfo)
	if err := r.fr.WritePing(false, [8]byte{1}); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.next().(*http2.PingFrame); !ok {
		t.Fatal("no PING ack") // the headers were read before it
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		g.stop()
	}()
	testkit.Eventually(t, 5*time.Second, "stop under way", g.isStopped)
	r.open(3, false, getInfo)
	if err := r.fr.WriteData(1, true, framed(nil)); err != nil {
		t.Fatal(err)
	}
	var answered, refused bool
	for f := r.next(); ; f = r.next() {
		switch f := f.(type) {
		case nil:
			t.Fatal("the connection closed without a GOAWAY")
		case *http2.MetaHeadersFrame:
			answered = answered || f.StreamID == 1 && f.StreamEnded()
		case *http2.RSTStreamFrame:
			refused = refused || f.StreamID == 3 && f.ErrCode == http2.ErrCodeRefusedStream
		case *http2.GoAwayFrame:
			if !answered || f.ErrCode != http2.ErrCodeNo || f.LastStreamID != 3 {
				t.Errorf("GOAWAY %v, last stream %d, with stream 1 answered: %v; want NO_ERROR, 3, after stream 1's answer", f.ErrCode, f.LastStreamID, answered)
			}
			if !refused {
				t.Error("stream 3, opened after stop, was not refused")
			}
			<-stopped
			return
		}
	}
}

// TestRPCDropsAClientThatDoesNotRead: a client that sends and never reads its replies is
// dropped once a write has waited writeTimeout, and the socket's path is logged.
func TestRPCDropsAClientThatDoesNotRead(t *testing.T) {
	defer func(d time.Duration) { writeTimeout = d }(writeTimeout)
	writeTimeout = 200 * time.Millisecond
	var log testkit.Buffer
	_, gs := serveTestLog(t, 1, log.Logger())
	path := gs[0].path
	r := dialRaw(t, path, true)
	_ = r.c.SetWriteDeadline(time.Now().Add(time.Minute))
	for {
		if err := r.fr.WritePing(false, [8]byte{1}); err != nil {
			break // the server closed the connection
		}
	}
	testkit.Eventually(t, 5*time.Second, "the drop logged", func() bool {
		return strings.Contains(log.String(), "read no reply") && strings.Contains(log.String(), path)
	})
}
