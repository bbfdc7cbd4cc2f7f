package handover

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"multireg.dev/multireg/config"
)

// TestBatchesFitAMessage: batches stay under maxBatchBytes of JSON and batchDrivers drivers in
// every version, whatever the sizes of the drivers' statuses (a last error is cut to
// maxLastError on the wire), so that each fits one SOCK_SEQPACKET message.
func TestBatchesFitAMessage(t *testing.T) {
	long := strings.Repeat("kubelet rejected the registration: é ", 200)
	var ds []*Driver
	for i := range 300 {
		name := fmt.Sprintf("d%d.example.com", i)
		st := Status{LastError: long[:min(i*25, len(long))]}
		ds = append(ds, &Driver{Spec: config.Driver{Registration: config.Registration{Name: name, Type: config.CSIPlugin}}, Status: st})
	}
	for v := minVersion; v <= maxVersion; v++ {
		n := 0
		for _, b := range batches(ds, v) {
			raw, err := json.Marshal(&Msg{Type: MsgBatch, Version: v, Drivers: b})
			if err != nil {
				t.Fatal(err)
			}
			if len(b) == 0 || len(b) > batchDrivers || len(raw) > maxBatchBytes+1024 {
				t.Errorf("version %d: a batch of %d drivers, %d bytes", v, len(b), len(raw))
			}
			n += len(b)
		}
		if n != len(ds) {
			t.Errorf("version %d: %d drivers in the batches, want %d", v, n, len(ds))
		}
	}
	if b := batches(nil, maxVersion); len(b) != 1 || len(b[0]) != 0 {
		t.Errorf("no driver: %d batches, want one empty batch (it carries the lock)", len(b))
	}
}
