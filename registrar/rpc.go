package registrar

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// A registration socket speaks gRPC, and kubelet calls it with gRPC's client, but it is not
// served by gRPC's server. Kubelet registering 1000 drivers at once holds 1000 connections
// open (each from GetInfo until its verdict), and gRPC's server keeps three goroutines and
// their buffers per connection: some 40 KiB each, 40 MiB at the start-up peak. The service has
// two unary calls with messages of a few hundred bytes, so each connection is served here by
// one goroutine speaking the part of HTTP/2 that gRPC's unary calls use (the gRPC over HTTP/2
// protocol: github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md). x/net's framer and
// HPACK codec, gRPC's own, read and write the frames.
//
// What is served: one or more calls at a time on a connection (up to maxCallStreams), each a
// request message and a response message or a status; connection and stream flow control;
// SETTINGS, PING, WINDOW_UPDATE, RST_STREAM and GOAWAY. Not served, as kubelet never uses
// them: compressed messages (answered Unimplemented), server push, priorities, streaming calls.

const (
	// maxCallStreams is the number of calls a connection may have open at once. Kubelet makes
	// one at a time; a client that opens more is refused the extra streams (REFUSED_STREAM),
	// which gRPC's client waits for rather than fails on, as it respects the setting.
	maxCallStreams = 16
	// maxRequest bounds a request message: kubelet's are a few hundred bytes, with a reason
	// for a rejection that may run longer; gRPC's own default is 4 MiB.
	maxRequest = 1 << 20
	// maxHeaderList bounds a request's header block (SETTINGS_MAX_HEADER_LIST_SIZE).
	maxHeaderList = 16 << 10
	// handshakeTimeout bounds the wait for the client's preface, as gRPC's server does
	// (ConnectionTimeout).
	handshakeTimeout = 2 * time.Minute
	// maxFrame is the largest frame a client may send: HTTP/2's default, which gRPC's client
	// keeps to.
	maxFrame = 16384
	// readBuffer is a connection's read buffer: a request's frames take a few hundred bytes.
	readBuffer = 1024
	// initialWindow is the flow-control window both ends start with (RFC 9113 §6.9.2).
	initialWindow = 65535
	// maxWindow is the largest flow-control window (RFC 9113 §6.9.1).
	maxWindow = 1<<31 - 1
)

// writeTimeout bounds one write of frames: replies are small, and a client that reads
// nothing for this long is gone. A variable for the tests.
var writeTimeout = 10 * time.Second

// rpcConn is one client connection to a registration socket and the calls open on it. Only
// its goroutine (serve) uses it.
type rpcConn struct {
	g  *generation
	c  net.Conn
	id uint64 // numbers the connection for the registration server (see registrationServer)

	r   *bufio.Reader
	fr  *http2.Framer
	out bytes.Buffer // frames written, sent by flush
	hdr bytes.Buffer // a header block being encoded
	enc *hpack.Encoder

	calls    map[uint32]*rpcCall
	pending  int    // the bytes of requests in calls, bounded by maxRequest
	lastID   uint32 // the highest stream the client opened
	maxFrame int    // the client's SETTINGS_MAX_FRAME_SIZE
	window   int64  // what may be sent on the connection (flow control)
	initial  int64  // the client's SETTINGS_INITIAL_WINDOW_SIZE, a new stream's window

	read     int64 // bytes read from c
	boundary int64 // bytes of c the framer had read when its last frame ended
	draining bool  // the generation stopped: the calls open then are being finished
	wfailed  bool  // a write failed: the client is gone or does not read
}

// rpcCall is a call whose request is being received.
type rpcCall struct {
	method string
	agent  string // the client's user agent: kubelet's names its gRPC release (kubelet.go)
	req    []byte // the request's gRPC framing: a compressed flag, a length, the message
	window int64  // what may be sent on the stream
}

// rpcStatus is a call's failure, as gRPC's status.
type rpcStatus struct {
	code codes.Code
	msg  string
}

func failed(code codes.Code, format string, args ...any) *rpcStatus {
	return &rpcStatus{code: code, msg: fmt.Sprintf(format, args...)}
}

func newRPCConn(g *generation, c net.Conn) *rpcConn {
	rc := &rpcConn{g: g, c: c, id: connIDs.Add(1), calls: map[uint32]*rpcCall{},
		maxFrame: maxFrame, window: initialWindow, initial: initialWindow} // HTTP/2's defaults, until the client's SETTINGS
	// A frame is read in two reads (its header, then its payload); the buffer makes them one
	// system call for a request's few frames.
	rc.r = bufio.NewReaderSize(connReader{rc}, readBuffer)
	rc.fr = http2.NewFramer(&rc.out, rc.r)
	rc.fr.SetMaxReadFrameSize(maxFrame) // SETTINGS_MAX_FRAME_SIZE, not advertised: the default
	rc.fr.SetReuseFrames()
	rc.fr.MaxHeaderListSize = maxHeaderList
	rc.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	rc.enc = hpack.NewEncoder(&rc.hdr)
	// No dynamic table: the replies' few headers are encoded literally or from the static
	// table, and no state is kept for them.
	rc.enc.SetMaxDynamicTableSizeLimit(0)
	return rc
}

// serve serves the connection until the client closes it, breaks the protocol, or the
// generation stops. stop interrupts the read with a deadline: the calls the client began are
// answered first (connReader), then GOAWAY tells the client that no other was.
func (rc *rpcConn) serve() {
	defer rc.c.Close()
	defer rc.g.rs.forget(rc.id)
	if err := rc.handshake(); err != nil {
		rc.fail(err)
		return
	}
	rc.boundary = rc.read - int64(rc.r.Buffered())
	for {
		f, err := rc.fr.ReadFrame()
		if err == nil {
			err = rc.handle(f)
		}
		var se http2.StreamError
		if errors.As(err, &se) {
			if se.StreamID%2 == 1 && se.StreamID > rc.lastID {
				rc.lastID = se.StreamID // its headers opened it, and broke a rule: its DATA is dropped
			}
			rc.drop(se.StreamID)
			err = rc.fr.WriteRSTStream(se.StreamID, se.Code)
		}
		if err == nil {
			err = rc.flush()
		}
		if err == nil && rc.draining && len(rc.calls) == 0 {
			err = os.ErrDeadlineExceeded // the calls begun before stop are answered
		}
		if err != nil {
			rc.fail(err)
			return
		}
		rc.boundary = rc.read - int64(rc.r.Buffered())
	}
}

// connReader reads the connection for the framer. When the generation stops, its deadline
// fails the read at once; but if the client has begun a call (its headers are read, or a
// frame is half read), the read goes on for stopGrace, so that the call is answered: the
// client cannot tell such a call from one that was served, and gRPC's would not retry it.
type connReader struct{ rc *rpcConn }

func (r connReader) Read(p []byte) (int, error) {
	rc := r.rc
	for {
		n, err := rc.c.Read(p)
		rc.read += int64(n)
		if n > 0 || rc.draining || !errors.Is(err, os.ErrDeadlineExceeded) || !rc.g.isStopped() {
			return n, err
		}
		rc.draining = true
		if len(rc.calls) == 0 && rc.read == rc.boundary {
			return n, err
		}
		_ = rc.c.SetReadDeadline(time.Now().Add(stopGrace))
	}
}

// handshake reads the client's preface and sends the server's: its SETTINGS.
func (rc *rpcConn) handshake() error {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(rc.r, preface); err != nil {
		return err
	}
	if string(preface) != http2.ClientPreface {
		return errNotHTTP2{preface}
	}
	if !rc.g.setDeadline(rc.c, time.Time{}) {
		return os.ErrDeadlineExceeded // stopping
	}
	if err := rc.fr.WriteSettings(
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: maxCallStreams},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderList},
	); err != nil {
		return err
	}
	return rc.flush()
}

// protocolError ends a connection whose client broke the protocol: code says how, in a GOAWAY.
type protocolError struct {
	code   http2.ErrCode
	reason string
}

func (e *protocolError) Error() string { return e.reason }

func connError(code http2.ErrCode, format string, args ...any) error {
	return &protocolError{code: code, reason: fmt.Sprintf(format, args...)}
}

// errNotHTTP2 ends a connection whose client did not start with HTTP/2's preface.
type errNotHTTP2 struct{ began []byte }

func (e errNotHTTP2) Error() string {
	return fmt.Sprintf("the client does not speak HTTP/2: it began with %q", e.began)
}

// fail ends the connection on err. A client that broke the protocol is told why (GOAWAY) and
// the socket's path is logged with it; when the generation stops, the client is told GOAWAY;
// one that went, or whose connection failed, nothing.
func (rc *rpcConn) fail(err error) {
	if rc.wfailed {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			rc.g.hub.log.Warn("ended a connection to a registration socket: its client read no reply for "+writeTimeout.String(),
				"socket", rc.g.path)
		}
		return
	}
	var code http2.ErrCode
	var ce http2.ConnectionError
	var pe *protocolError
	var np errNotHTTP2
	switch {
	case errors.As(err, &pe):
		code = pe.code
	case errors.As(err, &ce):
		code = http2.ErrCode(ce)
		if d := rc.fr.ErrorDetail(); d != nil {
			err = d
		}
	case errors.Is(err, http2.ErrFrameTooLarge):
		code = http2.ErrCodeFrameSize
	case errors.As(err, &np):
		code = http2.ErrCodeProtocol
	case errors.Is(err, os.ErrDeadlineExceeded):
		code = http2.ErrCodeNo // the generation stops, or the client sent no preface in handshakeTimeout
	default:
		return // the client went, or its connection failed
	}
	var debug []byte
	if code != http2.ErrCodeNo {
		rc.g.hub.log.Warn("ended a connection to a registration socket: its client broke the protocol",
			"socket", rc.g.path, "code", code, "err", err)
		debug = []byte(err.Error())
	}
	if rc.fr.WriteGoAway(rc.lastID, code, debug) == nil {
		_ = rc.flush()
	}
}

// flush sends the frames written since the last flush.
func (rc *rpcConn) flush() error {
	if rc.out.Len() == 0 {
		return nil
	}
	_ = rc.c.SetWriteDeadline(time.Now().Add(writeTimeout))
	_, err := rc.c.Write(rc.out.Bytes())
	rc.out.Reset()
	if err != nil {
		rc.wfailed = true
	}
	return err
}

// handle handles one frame from the client. An error is the connection's end, or a
// StreamError that ends only its stream.
func (rc *rpcConn) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if err := f.ForeachSetting(rc.setting); err != nil {
			return err
		}
		return rc.fr.WriteSettingsAck()
	case *http2.PingFrame:
		if f.IsAck() {
			return nil
		}
		return rc.fr.WritePing(true, f.Data)
	case *http2.WindowUpdateFrame:
		return rc.windowUpdate(f)
	case *http2.MetaHeadersFrame:
		return rc.headers(f)
	case *http2.DataFrame:
		return rc.data(f)
	case *http2.RSTStreamFrame:
		if f.StreamID > rc.lastID {
			return connError(http2.ErrCodeProtocol, "RST_STREAM on stream %d, which it never opened", f.StreamID)
		}
		rc.drop(f.StreamID)
		return nil
	case *http2.PushPromiseFrame:
		return connError(http2.ErrCodeProtocol, "PUSH_PROMISE from a client")
	default:
		return nil // GOAWAY (the client makes no new call; those open are answered), PRIORITY, unknown frames
	}
}

// setting applies one of the client's settings.
func (rc *rpcConn) setting(s http2.Setting) error {
	if err := s.Valid(); err != nil {
		return err
	}
	switch s.ID {
	case http2.SettingInitialWindowSize:
		delta := int64(s.Val) - rc.initial
		rc.initial = int64(s.Val)
		for _, c := range rc.calls {
			if c.window += delta; c.window > maxWindow {
				return connError(http2.ErrCodeFlowControl, "SETTINGS_INITIAL_WINDOW_SIZE %d takes a stream's window over 2^31-1", s.Val)
			}
		}
	case http2.SettingMaxFrameSize:
		rc.maxFrame = int(s.Val)
	}
	// SETTINGS_HEADER_TABLE_SIZE needs nothing: the replies use no dynamic table.
	return nil
}

func (rc *rpcConn) windowUpdate(f *http2.WindowUpdateFrame) error {
	if f.StreamID == 0 {
		if rc.window += int64(f.Increment); rc.window > maxWindow {
			return connError(http2.ErrCodeFlowControl, "WINDOW_UPDATE takes the connection's window over 2^31-1")
		}
		return nil
	}
	if c := rc.calls[f.StreamID]; c != nil {
		if c.window += int64(f.Increment); c.window > maxWindow {
			return http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeFlowControl}
		}
	}
	return nil
}

// headers opens a call.
func (rc *rpcConn) headers(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	if id <= rc.lastID {
		if rc.calls[id] == nil {
			return connError(http2.ErrCodeStreamClosed, "HEADERS on stream %d, which is closed", id)
		}
		if !f.StreamEnded() {
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol, Cause: errors.New("a second HEADERS that does not end the request")}
		}
		return rc.end(id) // the request's trailers: gRPC's clients send none, but may
	}
	if id%2 == 0 {
		return connError(http2.ErrCodeProtocol, "HEADERS on stream %d: even streams are the server's", id)
	}
	rc.lastID = id
	if len(rc.calls) >= maxCallStreams || rc.draining {
		// gRPC's client retries a refused stream: on another connection, once this one ends
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeRefusedStream}
	}
	c := &rpcCall{method: f.PseudoValue("path"), agent: header(f, "user-agent"), window: rc.initial}
	rc.calls[id] = c
	var st *rpcStatus
	switch ct := header(f, "content-type"); {
	case f.Truncated:
		st = failed(codes.ResourceExhausted, "the request's headers exceed %d bytes", maxHeaderList)
	case f.PseudoValue("method") != "POST":
		st = failed(codes.Unimplemented, "method %q: only POST carries gRPC calls", f.PseudoValue("method"))
	case ct != "application/grpc" && !strings.HasPrefix(ct, "application/grpc+") && !strings.HasPrefix(ct, "application/grpc;"):
		st = failed(codes.Unimplemented, "content-type %q is not gRPC's", ct)
	}
	if st != nil {
		return rc.refuse(id, !f.StreamEnded(), st)
	}
	if f.StreamEnded() {
		return rc.end(id)
	}
	return nil
}

// header returns the value of a request header (the first, if repeated), "" when absent.
func header(f *http2.MetaHeadersFrame, name string) string {
	for _, hf := range f.RegularFields() {
		if hf.Name == name {
			return hf.Value
		}
	}
	return ""
}

// data receives part of a request. The flow-control windows are given back at once: a
// request is bounded by maxRequest, not by the window.
func (rc *rpcConn) data(f *http2.DataFrame) error {
	id := f.StreamID
	if n := f.Length; n > 0 {
		if err := rc.fr.WriteWindowUpdate(0, n); err != nil {
			return err
		}
	}
	c := rc.calls[id]
	if c == nil {
		if id > rc.lastID {
			return connError(http2.ErrCodeProtocol, "DATA on stream %d, which it never opened", id)
		}
		return nil // a call already answered or reset: its data is dropped
	}
	if rc.pending+len(f.Data()) > maxRequest+5 {
		return rc.refuse(id, !f.StreamEnded(), failed(codes.ResourceExhausted, "the request is larger than %d bytes (with the other requests open on the connection)", maxRequest))
	}
	c.req = append(c.req, f.Data()...)
	rc.pending += len(f.Data())
	if f.StreamEnded() {
		return rc.end(id)
	}
	if n := f.Length; n > 0 {
		return rc.fr.WriteWindowUpdate(id, n)
	}
	return nil
}

// end answers a call whose request is whole.
func (rc *rpcConn) end(id uint32) error {
	c := rc.calls[id]
	resp, st := rc.call(c)
	if st != nil {
		return rc.refuse(id, false, st)
	}
	rc.drop(id)
	msg := make([]byte, 5, 5+len(resp))
	binary.BigEndian.PutUint32(msg[1:], uint32(len(resp)))
	msg = append(msg, resp...)
	if n := int64(len(msg)); n > rc.window || n > c.window {
		// Never with gRPC's client, whose windows start at 64 KiB and are given back as it
		// reads; waiting for a window would hold the reply in memory instead.
		return rc.status(id, failed(codes.ResourceExhausted, "the reply (%d bytes) exceeds the client's flow-control window", n))
	}
	rc.window -= int64(len(msg))
	if err := rc.writeHeaders(id, false, ":status", "200", "content-type", "application/grpc"); err != nil {
		return err
	}
	for len(msg) > 0 {
		n := min(len(msg), rc.maxFrame)
		if err := rc.fr.WriteData(id, false, msg[:n]); err != nil {
			return err
		}
		msg = msg[n:]
	}
	return rc.writeHeaders(id, true, "grpc-status", "0")
}

// call runs the call c on the registration server.
func (rc *rpcConn) call(c *rpcCall) ([]byte, *rpcStatus) {
	if len(c.req) < 5 {
		return nil, failed(codes.Internal, "the request has no message")
	}
	if c.req[0] != 0 {
		return nil, failed(codes.Unimplemented, "compressed messages are not served")
	}
	if n := binary.BigEndian.Uint32(c.req[1:5]); int(n) != len(c.req)-5 {
		return nil, failed(codes.Internal, "the request's message is %d bytes, its framing says %d", len(c.req)-5, n)
	}
	msg := c.req[5:]
	switch c.method {
	case registerapi.Registration_GetInfo_FullMethodName:
		if err := proto.Unmarshal(msg, &registerapi.InfoRequest{}); err != nil {
			return nil, failed(codes.Internal, "cannot read the request: %v", err)
		}
		return rc.g.rs.getInfo(rc.id, c.agent)
	case registerapi.Registration_NotifyRegistrationStatus_FullMethodName:
		var st registerapi.RegistrationStatus
		if err := proto.Unmarshal(msg, &st); err != nil {
			return nil, failed(codes.Internal, "cannot read the request: %v", err)
		}
		return rc.g.rs.notifyStatus(rc.id, &st)
	default:
		return nil, failed(codes.Unimplemented, "unknown method %q", c.method)
	}
}

// refuse answers a call with a status, and asks the client to stop sending its request if
// it has not finished (RST_STREAM with NO_ERROR, RFC 9113 §8.1).
func (rc *rpcConn) refuse(id uint32, open bool, st *rpcStatus) error {
	if err := rc.status(id, st); err != nil {
		return err
	}
	if open {
		return rc.fr.WriteRSTStream(id, http2.ErrCodeNo)
	}
	return nil
}

// drop forgets the call on stream id, if open.
func (rc *rpcConn) drop(id uint32) {
	if c := rc.calls[id]; c != nil {
		rc.pending -= len(c.req)
		delete(rc.calls, id)
	}
}

// status answers a call with a status alone (gRPC's Trailers-Only response).
func (rc *rpcConn) status(id uint32, st *rpcStatus) error {
	rc.drop(id)
	msg := st.msg
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	return rc.writeHeaders(id, true, ":status", "200", "content-type", "application/grpc",
		"grpc-status", fmt.Sprint(uint32(st.code)), "grpc-message", percentEncode(msg))
}

// writeHeaders writes a header block of name, value pairs. Replies' blocks are small: one
// frame holds each.
func (rc *rpcConn) writeHeaders(id uint32, end bool, fields ...string) error {
	rc.hdr.Reset()
	for i := 0; i < len(fields); i += 2 {
		if err := rc.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]}); err != nil {
			return err
		}
	}
	return rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: rc.hdr.Bytes(), EndStream: end, EndHeaders: true})
}

// percentEncode encodes a grpc-message value: printable ASCII but '%' as is, every other
// byte as %XX.
func percentEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= ' ' && c <= '~' && c != '%' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}
