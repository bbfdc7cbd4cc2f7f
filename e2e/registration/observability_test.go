package registration

import (
	"strings"
	"testing"

	"multireg.dev/multireg/e2e/internal/fileid"
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

// A driver configured for every node but not deployed on this one: its endpoint never
// appears. It is absent: /readyz stays 200 and names it, /status and /metrics say so. Made
// required by an edit, it fails readiness without any registration being touched; once its
// endpoint appears it registers and /readyz is green again.
func TestAbsentDriverDoesNotFailReadiness(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	here := driver{Name: "here.csi.example.com", Type: "CSIPlugin"}
	gone := driver{Name: "example.com/fpga", Type: "DevicePlugin"}
	e.StartEndpoint(here)
	p := mrproc.Start(t, e.WriteConfig([]driver{here, gone}))
	get := func(path string) (int, string) {
		code, body, err := p.Get(t, path)
		if err != nil {
			t.Fatal(err)
		}
		return code, body
	}
	wait.For(t, registerTimeout, "/readyz 200 naming the absent driver", func() bool {
		code, body := get("/readyz")
		return code == 200 && strings.Contains(body, "ok: 1 of 2 drivers registered, 1 absent from this node") &&
			strings.Contains(body, "absent (not required): example.com/fpga")
	})
	if !e.K.Registered(here.Name) {
		t.Errorf("%s not registered in kubelet", here.Name)
	}
	if d, ok := p.Status(t).Driver(gone.Name); !ok || !d.Absent || d.Required || d.Phase != "WaitingForEndpoint" {
		t.Errorf("/status of the absent driver: %+v", d)
	}
	if m, want := p.Metrics(t), `multireg_driver_absent{driver="example.com/fpga"} 1`; !strings.Contains(m, want) {
		t.Errorf("/metrics lacks %s", want)
	}
	out, code := mrproc.Run(t, "status", "--http-endpoint", p.HTTPAddr())
	if code != 0 || !strings.Contains(out, "1 of 2 drivers registered, 1 absent from this node") {
		t.Errorf("multireg status (exit %d):\n%s", code, out)
	}

	// Required by an edit: not ready, and nothing is registered anew.
	before := e.Registrations([]driver{here})
	sock := fileid.Of(e.SocketPath(here))
	required := gone
	required.Extra = "    required: true\n"
	e.WriteConfig([]driver{here, required})
	wait.For(t, registerTimeout, "/readyz 503 naming the required absent driver", func() bool {
		code, body := get("/readyz")
		return code == 503 && strings.Contains(body, "example.com/fpga: WaitingForEndpoint: required, and absent from this node")
	})
	if after := e.Registrations([]driver{here}); after[here.Name] != before[here.Name] || fileid.Of(e.SocketPath(here)) != sock {
		t.Errorf("the edit of another driver's required re-registered %s: registrations %d → %d", here.Name, before[here.Name], after[here.Name])
	}
	// The reload is logged once it is applied, which readiness may show first.
	wait.For(t, registerTimeout, "the reload logged", func() bool { return p.Count("config reloaded", "") >= 1 })
	if n := p.Count("config reloaded", ""); n != 1 {
		t.Errorf("%d reloads logged, want 1", n)
	}

	// Deployed after all: it registers and /readyz is green.
	e.StartEndpoint(required)
	wait.For(t, registerTimeout, "the driver registered once its endpoint appears", func() bool { return e.K.Registered(gone.Name) })
	wait.For(t, registerTimeout, "/readyz green", func() bool {
		code, body := get("/readyz")
		return code == 200 && strings.Contains(body, "ok: 2 of 2 drivers registered")
	})
}
