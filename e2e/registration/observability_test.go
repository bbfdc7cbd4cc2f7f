package registration

import (
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/internal/wait"
	"multireg.dev/multireg/e2e/mrproc"
)

// A driver rejected by kubelet: /readyz, /status, /metrics and `multireg status` all name it
// and give kubelet's reason; after the retry is accepted, all turn green.
func TestObservabilityNamesTheRejectedDriver(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	good := driver{Name: "good.csi.example.com", Type: "CSIPlugin"}
	bad := driver{Name: "bad.csi.example.com", Type: "CSIPlugin", Extra: "    backoff: {initialInterval: 4s, maxInterval: 4s}\n"}
	e.StartEndpoint(good)
	e.StartEndpoint(bad)
	e.K.FailRegistrations(bad.Name, 1)
	p := mrproc.Start(t, e.WriteConfig([]driver{good, bad}))
	get := func(path string) (int, string) {
		code, body, err := p.Get(t, path)
		if err != nil {
			t.Fatal(err)
		}
		return code, body
	}

	const reason = "injected registration failure"
	wait.For(t, registerTimeout, "/readyz to name the rejected driver and kubelet's reason", func() bool {
		code, body := get("/readyz")
		return code == 503 && strings.Contains(body, "bad.csi.example.com: BackingOff: kubelet rejected the registration: RegisterPlugin error -- plugin registration failed with err:") &&
			strings.Contains(body, reason) && !strings.Contains(body, good.Name)
	})
	if doc := p.Status(t); len(doc.Drivers) != 2 || doc.Drivers[0].Name != bad.Name || doc.Drivers[0].Phase != "BackingOff" || !strings.Contains(doc.Drivers[0].LastError, reason) {
		t.Errorf("/status: %+v", doc)
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
	wait.For(t, registerTimeout, "kubelet registers the retried driver", func() bool { return e.K.Registered(bad.Name) })
	wait.For(t, registerTimeout, "/readyz green", func() bool { code, _ := get("/readyz"); return code == 200 })
	_, metrics = get("/metrics")
	if want := `multireg_driver_registered{driver="bad.csi.example.com",type="CSIPlugin"} 1`; !strings.Contains(metrics, want) {
		t.Errorf("/metrics lacks %s", want)
	}
	out, code = mrproc.Run(t, "status", "--http-endpoint", p.HTTPAddr())
	if code != 0 || !strings.Contains(out, "2 of 2 drivers registered") {
		t.Errorf("multireg status after the recovery (exit %d):\n%s", code, out)
	}
}
