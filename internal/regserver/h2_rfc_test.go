package regserver

import (
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// HTTP/2 abuse of the registration sockets, re-checked against grpc-go's server. Request
// trailers on a stream the server has ended still close the connection: grpc-go's
// (http2Server.operateHeaders refuses a stream id at or below the highest seen), not ours, and
// kubelet sends none.

// TestAReplyWaitsForTheClientsWindow: a reply larger than the client's flow-control window is
// sent as the window opens, not failed.
func TestAReplyWaitsForTheClientsWindow(t *testing.T) {
	_, gs := serveTest(t, 1)
	p := dialH2(t, gs[0].path)
	if err := p.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 8}); err != nil {
		t.Fatal(err)
	}
	p.call(1, "GetInfo")
	if err := p.fr.WriteData(1, true, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	// The reply (some 40 bytes) does not fit in 8: what fits comes, then it waits for window.
	_ = p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("no part of the reply: %v", err)
		}
		if d, ok := f.(*http2.DataFrame); ok && d.StreamID == 1 {
			if len(d.Data()) > 8 {
				t.Fatalf("%d bytes of the reply sent in a window of 8", len(d.Data()))
			}
			break
		}
		if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == 1 && h.StreamEnded() {
			t.Fatal("the call ended before the window opened")
		}
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			_ = p.fr.WriteSettingsAck()
		}
	}
	if err := p.fr.WriteWindowUpdate(1, 1<<16); err != nil {
		t.Fatal(err)
	}
	if st, closed := p.ended(1, 5*time.Second); closed || st != "0" {
		t.Errorf("a reply larger than the client's window: grpc-status %q (connection closed: %v), want 0", st, closed)
	}
}
