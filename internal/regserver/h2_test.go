package regserver

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2 is a hand-driven HTTP/2 client of a registration socket: what a hostile or broken peer
// sends, frame by frame.
type h2 struct {
	t  testing.TB
	c  net.Conn
	fr *http2.Framer
}

// dialH2 connects to path and sends the client preface and SETTINGS.
func dialH2(t testing.TB, path string) *h2 {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	return newH2(t, c)
}

// newH2 sends the client preface and SETTINGS on c.
func newH2(t testing.TB, c net.Conn) *h2 {
	t.Helper()
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return &h2{t: t, c: c, fr: fr}
}

// call sends a call's HEADERS on stream id, without ending it.
func (p *h2) call(id uint32, method string) {
	p.t.Helper()
	var b bytes.Buffer
	e := hpack.NewEncoder(&b)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", "/pluginregistration.Registration/" + method},
		{":authority", "localhost"}, {"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = e.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: b.Bytes(), EndHeaders: true}); err != nil {
		p.t.Fatal(err)
	}
}

// body sends, on stream id, the start of a gRPC message that says it is size bytes long:
// its prefix and sent bytes, never the rest.
func (p *h2) body(id uint32, size, sent int) {
	p.t.Helper()
	msg := make([]byte, 5+sent)
	binary.BigEndian.PutUint32(msg[1:], uint32(size))
	for len(msg) > 0 {
		n := min(len(msg), 16<<10)
		if err := p.fr.WriteData(id, false, msg[:n]); err != nil {
			p.t.Fatal(err)
		}
		msg = msg[n:]
	}
}

// ended waits until stream id ends (trailers or RST_STREAM) and returns its grpc-status
// ("" for a reset); closed when the connection ended first. It fails the test after d.
func (p *h2) ended(id uint32, d time.Duration) (st string, closed bool) {
	p.t.Helper()
	st, closed, ok := p.endedWithin(id, d)
	if !ok {
		p.t.Fatalf("stream %d still open after %s", id, d)
	}
	return st, closed
}

// endedWithin is ended, with ok false when the stream is still open after d.
func (p *h2) endedWithin(id uint32, d time.Duration) (st string, closed, ok bool) {
	st, closed, err := p.readEnd(id, d)
	return st, closed, !errors.Is(err, os.ErrDeadlineExceeded)
}

func (p *h2) readEnd(id uint32, d time.Duration) (string, bool, error) {
	_ = p.c.SetReadDeadline(time.Now().Add(d))
	dec := hpack.NewDecoder(4096, nil)
	for {
		f, err := p.fr.ReadFrame()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return "", false, err
		}
		if err != nil {
			return "", true, nil
		}
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				return "", false, nil
			}
		case *http2.GoAwayFrame:
			return "", true, nil
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = p.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				_ = p.fr.WritePing(true, f.Data)
			}
		case *http2.HeadersFrame:
			fields, _ := dec.DecodeFull(f.HeaderBlockFragment())
			if f.StreamID != id || !f.StreamEnded() {
				continue
			}
			for _, hf := range fields {
				if hf.Name == "grpc-status" {
					return hf.Value, false, nil
				}
			}
			return "?", false, nil
		}
	}
}

// closedWithin reports whether the server closed the connection within d (reading and
// dropping what it sends, and answering nothing).
func (p *h2) closedWithin(d time.Duration) bool {
	_ = p.c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	for {
		if _, err := p.c.Read(buf); err != nil {
			return !errors.Is(err, os.ErrDeadlineExceeded)
		}
	}
}
