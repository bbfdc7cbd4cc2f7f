package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// A status document's beginning, what repeats in its drivers array (a driver as the daemon
// writes it, indented JSON), and its end.
const (
	statusTail  = `{"name": "last.csi.k8s.io", "type": "CSIPlugin", "phase": "Serving"}]}`
	statusHead  = `{"instance": {"role": "serving"}, "config": {"path": "/etc/multireg/config.yaml", "generation": 1, "lastReloadSuccessful": true}, "drivers": [`
	statusEntry = `
    {
      "name": "nfs.csi.k8s.io",
      "type": "CSIPlugin",
      "phase": "Registered",
      "socket": "/var/lib/kubelet/plugins_registry/nfs.csi.k8s.io-reg.sock",
      "endpoint": "/var/lib/kubelet/plugins/csi-nfsplugin/csi.sock",
      "endpointUp": true,
      "absent": false,
      "required": false,
      "heldByOther": false,
      "attempts": 1,
      "failures": 0,
      "lastError": "",
      "since": "2026-11-21T23:23:06.861Z",
      "nextAttempt": null
    },`
)

// serveStatus answers GET /status with a status document of n bytes, made of statusEntry up
// to entries times (-1: as many as fit) and padded with spaces, written as it goes: never
// held whole. With length, the answer says its length (Content-Length); otherwise it is
// chunked. It counts what it wrote.
func serveStatus(t *testing.T, n int64, length bool, entries int) (addr string, written func() int64) {
	t.Helper()
	var count int64
	done := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() { done <- struct{}{} }()
		if length {
			w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		}
		w.Header().Set("Content-Type", "application/json")
		write := func(s string) bool {
			k, err := io.WriteString(w, s)
			count += int64(k)
			return err == nil
		}
		if !write(statusHead) {
			return
		}
		for i := 0; i != entries && count+int64(len(statusEntry)+len(statusTail)) <= n; i++ {
			if !write(statusEntry) {
				return
			}
		}
		pad := strings.Repeat(" ", int(n-count-int64(len(statusTail))))
		_ = write(pad) && write(statusTail)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, func() int64 { <-done; return count }
}

// TestStatusAnswerTooLarge: an answer of 1 GiB, chunked or with its length, is refused with
// what happened once 4 MiB are read (at once for the length), and multireg allocates a few
// MiB on the way: it never holds more of the answer than the bound.
func TestStatusAnswerTooLarge(t *testing.T) {
	for _, length := range []bool{false, true} {
		t.Run(fmt.Sprintf("Content-Length %v", length), func(t *testing.T) {
			addr, written := serveStatus(t, 1<<30, length, -1)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			err := run(context.Background(), []string{"status", "--http-endpoint", addr}, nil, io.Discard, io.Discard)
			runtime.ReadMemStats(&after)
			want := "multireg status: the answer of " + addr + "/status is over 4 MiB, the most multireg status reads (the status of some 6000 drivers): is it multireg's --http-endpoint?"
			if err == nil || err.Error() != want || exitCode(err) != 1 {
				t.Errorf("status against an answer of 1 GiB: %v; want %q", err, want)
			}
			if n := written(); n >= 1<<30 {
				t.Errorf("the server wrote all of its %d bytes; want the answer cut short", n)
			}
			// The server's writes are counted too; 24 MiB is 6 times the bound.
			alloc := after.TotalAlloc - before.TotalAlloc
			if alloc > 24<<20 {
				t.Errorf("multireg status allocated %d MiB for an answer of 1 GiB; want a few", alloc>>20)
			}
			t.Logf("allocated %.1f MiB", float64(alloc)/(1<<20))
		})
	}
}

// TestStatusBound: an answer of exactly maxStatusSize bytes is read and printed; one byte
// more is refused, whether the answer says its length or not.
func TestStatusBound(t *testing.T) {
	for _, length := range []bool{false, true} {
		for _, n := range []int64{maxStatusSize, maxStatusSize + 1} {
			t.Run(fmt.Sprintf("%d bytes, Content-Length %v", n, length), func(t *testing.T) {
				addr, _ := serveStatus(t, n, length, 100)
				var out bytes.Buffer
				err := run(context.Background(), []string{"status", "--http-endpoint", addr, "-o", "json"}, nil, &out, io.Discard)
				if n <= maxStatusSize {
					var doc statusDoc
					if err != nil || int64(out.Len()) != n || json.Unmarshal(out.Bytes(), &doc) != nil || len(doc.Drivers) != 101 {
						t.Errorf("status -o json of an answer of %d bytes: %v, %d bytes printed; want the answer", n, err, out.Len())
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), "is over 4 MiB") {
					t.Errorf("status of an answer of %d bytes: %v; want it refused", n, err)
				}
			})
		}
	}
}

// TestStatusStreams: what json.Unmarshal into a statusDoc and yaml.Marshal of the document
// give, decodeStatus and writeYAML give too, on the daemon's own document and odd ones.
func TestStatusStreams(t *testing.T) {
	daemon, err := json.MarshalIndent(newStatusDoc(serving(testState(knownStates, 2)).view()), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range []string{
		string(daemon),
		`{"drivers": null, "unknown": {"a": [1, 2.5, -3e7, true, null, "x"], "b": {}, "c": []}}`,
		`{"drivers": [{}, {"name": "a"}], "instance": {"role": "idle", "detail": "line 1\nline 2\ttab \"quoted\" \\ \u007f \u0085 \ufeff é"}}`,
		`{"drivers": [], "config": {"path": "yes", "lastReloadError": "- 1: #x [y] {z} 'q' ~ null true 0x1F 1e5 2026-11-21 : "}}`,
		`{"x": [[1, [2, {"y": [[]]}]], {"k": "v"}], "": "empty key", "a b": " lead", "trail ": "-"}`,
	} {
		var want statusDoc
		if err := json.Unmarshal([]byte(in), &want); err != nil {
			t.Fatal(err)
		}
		var drivers []driverStatus
		got, err := decodeStatus([]byte(in), func(d driverStatus) { drivers = append(drivers, d) })
		got.Drivers = drivers
		if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("decodeStatus(%s) = %+v, %v; want %+v", in, got, err, want)
		}

		var y bytes.Buffer
		if err := writeYAML(&y, []byte(in)); err != nil {
			t.Fatal(err)
		}
		var fromJSON, fromYAML any
		json.Unmarshal([]byte(in), &fromJSON)
		if err := yaml.Unmarshal(y.Bytes(), &fromYAML); err != nil {
			t.Errorf("writeYAML(%s) is not YAML: %v\n%s", in, err, y.String())
			continue
		}
		// yaml.v3 reads integers as int, JSON as float64: compare both as JSON.
		a, _ := json.Marshal(fromJSON)
		b, _ := json.Marshal(fromYAML)
		if !bytes.Equal(a, b) {
			t.Errorf("writeYAML(%s) reads back as\n%s\nwant\n%s\nYAML:\n%s", in, b, a, y.String())
		}
	}
	deep := func(n int) string { return `{"x": ` + strings.Repeat("[", n) + strings.Repeat("]", n) + "}" }
	if _, err := decodeStatus([]byte(deep(maxStatusDepth)), func(driverStatus) {}); err != nil {
		t.Errorf("a field %d deep: %v", maxStatusDepth, err)
	}
	for _, in := range []string{"", "null", "[]", `{"drivers": {}}`, `{"drivers": [1]}`, `{"instance": []}`, `{} {}`, `{"drivers": [`, deep(maxStatusDepth + 1)} {
		if _, err := decodeStatus([]byte(in), func(driverStatus) {}); err == nil {
			t.Errorf("decodeStatus(%q): no error; want one", in)
		}
	}
}

// TestStatusTableStreams: the table of a document with many drivers is the same whether the
// document is held whole or walked twice, and aligned as text/tabwriter aligned it.
func TestStatusTableStreams(t *testing.T) {
	doc := newStatusDoc(serving(testState(knownStates, 2)).view())
	var whole bytes.Buffer
	printStatus(&whole, doc, t0.Add(time.Second))
	body, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	head, err := decodeStatus(body, func(driverStatus) {})
	if err != nil {
		t.Fatal(err)
	}
	var walked bytes.Buffer
	err = printStatusTable(&walked, head, func(each func(driverStatus)) error {
		_, err := decodeStatus(body, each)
		return err
	}, t0.Add(time.Second))
	if err != nil || walked.String() != whole.String() {
		t.Errorf("walked twice: %v\n%s\nheld whole:\n%s", err, walked.String(), whole.String())
	}
}
