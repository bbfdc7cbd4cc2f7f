// Package h2flood floods multireg's registration sockets as a buggy or hostile local peer
// would: connections that send only the HTTP/2 preface and
// SETTINGS, or that start a NotifyRegistrationStatus call and never finish its request, each
// opened again as soon as multireg closes it. TestConnectionFlood (e2e/faults) and the attack
// command (e2e/cmd/attack) flood with it.
package h2flood

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Flood is one kind of flooding connection.
type Flood struct {
	// Unfinished: the connection starts a call whose request declares Size bytes and sends
	// all but its last byte, as the server's flow-control windows allow; otherwise it sends
	// the preface and SETTINGS only.
	Unfinished bool
	Size       int
	// Opened and Closed count the connections opened, and those multireg closed.
	Opened, Closed atomic.Int64
}

// Hold keeps one connection to sock open until ctx ends, opening it again whenever multireg
// closes it.
func (f *Flood) Hold(ctx context.Context, sock string) {
	for ctx.Err() == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", sock)
		if err != nil {
			// The socket is being recreated, or the backlog is full: try again shortly.
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		f.Opened.Add(1)
		stop := context.AfterFunc(ctx, func() { c.Close() })
		if err := f.harm(c); err == nil {
			// Wait for multireg to close it, reading (and dropping) what it sends.
			_, _ = io.Copy(io.Discard, c)
		}
		stop()
		c.Close()
		if ctx.Err() == nil {
			f.Closed.Add(1)
		}
	}
}

// harm sends what f's kind of connection sends on c. It returns errHeld when a reader of c
// goes on until c closes.
func (f *Flood) harm(c net.Conn) error {
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		return err
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		return err
	}
	if !f.Unfinished {
		return nil
	}
	var b bytes.Buffer
	e := hpack.NewEncoder(&b)
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "http"}, {":path", "/pluginregistration.Registration/NotifyRegistrationStatus"},
		{":authority", "localhost"}, {"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = e.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b.Bytes(), EndHeaders: true}); err != nil {
		return err
	}
	// The message's prefix and all but its last byte, in frames of 16 KiB at most, as the
	// server's flow-control windows allow: as a well-behaved client sends, so that the server
	// takes all of it.
	msg := make([]byte, 5+f.Size-1)
	binary.BigEndian.PutUint32(msg[1:], uint32(f.Size))
	w := newWindows()
	go w.read(fr)
	for len(msg) > 0 {
		n := w.take(min(len(msg), 16<<10))
		if n == 0 {
			return fmt.Errorf("connection closed")
		}
		if err := fr.WriteData(1, false, msg[:n]); err != nil {
			return err
		}
		msg = msg[n:]
	}
	w.drain() // the reader goes on reading until the connection closes
	return errHeld
}

// errHeld: harm's connection is being read by its windows' reader until it closes.
var errHeld = fmt.Errorf("held")

// windows follows the server's flow-control windows for stream 1 and the connection.
type windows struct {
	mu           sync.Mutex
	cond         *sync.Cond
	conn, stream int
	closed       bool
	done         chan struct{}
}

func newWindows() *windows {
	w := &windows{conn: 65535, stream: 65535, done: make(chan struct{})}
	w.cond = sync.NewCond(&w.mu)
	return w
}

// read reads the server's frames until the connection ends, opening the windows it opens.
func (w *windows) read(fr *http2.Framer) {
	defer close(w.done)
	for {
		f, err := fr.ReadFrame()
		w.mu.Lock()
		if err != nil {
			w.closed = true
			w.cond.Broadcast()
			w.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 {
				w.conn += int(f.Increment)
			} else {
				w.stream += int(f.Increment)
			}
		case *http2.SettingsFrame:
			if v, ok := f.Value(http2.SettingInitialWindowSize); ok && !f.IsAck() {
				w.stream += int(v) - 65535
			}
		case *http2.RSTStreamFrame:
			w.closed = true
		case *http2.HeadersFrame:
			w.closed = w.closed || f.StreamEnded() // the call's status
		}
		w.cond.Broadcast()
		w.mu.Unlock()
	}
}

// take waits until n bytes (or fewer, at least 1) may be sent, and takes them; 0 once the
// connection or the stream is closed.
func (w *windows) take(n int) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	for !w.closed && (w.conn <= 0 || w.stream <= 0) {
		w.cond.Wait()
	}
	if w.closed {
		return 0
	}
	n = min(n, w.conn, w.stream)
	w.conn -= n
	w.stream -= n
	return n
}

// drain waits for the reader to end.
func (w *windows) drain() { <-w.done }
