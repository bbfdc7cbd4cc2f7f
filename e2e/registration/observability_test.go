package registration

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/kubelet"
	"multireg.dev/multireg/e2e/mrproc"
)

// A driver rejected by kubelet: /readyz, /status, /metrics and `multireg status` all name it
// and give kubelet's reason; after the retry is accepted, all turn green.
func TestObservabilityNamesTheRejectedDriver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.dumpOnFailure()
	good := driver{name: "good.csi.example.com", typ: "CSIPlugin"}
	bad := driver{name: "bad.csi.example.com", typ: "CSIPlugin", extra: "    backoff: {initialInterval: 4s, maxInterval: 4s}\n"}
	e.startEndpoint(good)
	e.startEndpoint(bad)
	e.k.FailRegistrations(bad.name, 1)
	p := mrproc.Start(t, e.writeConfig([]driver{good, bad}))
	kubelet.WaitFor(t, registerTimeout, "the HTTP address", func() bool { return p.HTTPAddr() != "" })
	base := "http://" + p.HTTPAddr()
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	const reason = "injected registration failure"
	kubelet.WaitFor(t, registerTimeout, "/readyz to name the rejected driver and kubelet's reason", func() bool {
		code, body := get("/readyz")
		return code == 503 && strings.Contains(body, "bad.csi.example.com: BackingOff: kubelet rejected the registration: RegisterPlugin error -- plugin registration failed with err:") &&
			strings.Contains(body, reason) && !strings.Contains(body, good.name)
	})
	_, body := get("/status")
	var doc struct {
		Drivers []struct{ Name, Phase, LastError string }
	}
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Drivers) != 2 || doc.Drivers[0].Name != bad.name || doc.Drivers[0].Phase != "BackingOff" || !strings.Contains(doc.Drivers[0].LastError, reason) {
		t.Errorf("/status: %s", body)
	}
	_, metrics := get("/metrics")
	for _, want := range []string{
		`multireg_driver_registered{driver="bad.csi.example.com",type="CSIPlugin"} 0`,
		`multireg_driver_phase{driver="bad.csi.example.com",phase="BackingOff"} 1`,
		`multireg_registration_attempts_total{driver="bad.csi.example.com",result="rejected"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	out, code := mrproc.Run(t, "status", "--http-endpoint", p.HTTPAddr())
	if code != 0 || !strings.Contains(out, "1 of 2 drivers registered") || !strings.Contains(out, "bad.csi.example.com") || !strings.Contains(out, reason) {
		t.Errorf("multireg status (exit %d):\n%s", code, out)
	}

	// The retry is accepted: everything turns green.
	kubelet.WaitFor(t, registerTimeout, "kubelet registers the retried driver", func() bool { return e.k.Registered(bad.name) })
	kubelet.WaitFor(t, registerTimeout, "/readyz green", func() bool { code, _ := get("/readyz"); return code == 200 })
	_, metrics = get("/metrics")
	if want := `multireg_driver_registered{driver="bad.csi.example.com",type="CSIPlugin"} 1`; !strings.Contains(metrics, want) {
		t.Errorf("/metrics lacks %s", want)
	}
	out, code = mrproc.Run(t, "status", "--http-endpoint", p.HTTPAddr())
	if code != 0 || !strings.Contains(out, "2 of 2 drivers registered") {
		t.Errorf("multireg status after the recovery (exit %d):\n%s", code, out)
	}
}
