package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func runArgs(args ...string) (stdout, stderr string, err error) {
	return runStdin("", args...)
}

// runStdin runs multireg with stdin as its standard input.
func runStdin(stdin string, args ...string) (stdout, stderr string, err error) {
	var out, errOut bytes.Buffer
	err = run(context.Background(), args, strings.NewReader(stdin), &out, &errOut)
	return out.String(), errOut.String(), err
}

func TestValidate(t *testing.T) {
	valid := filepath.Join("..", "..", "config", "testdata", "valid-full.yaml")
	out, _, err := runArgs("validate", "--config", valid)
	if err != nil {
		t.Fatalf("validate %s: %v", valid, err)
	}
	if want := valid + ": valid: 3 drivers (1 CSIPlugin, 1 DRAPlugin, 1 DevicePlugin) in /var/lib/kubelet/plugins_registry\n"; out != want {
		t.Errorf("stdout %q, want %q", out, want)
	}

	invalid := filepath.Join("..", "..", "config", "testdata", "invalid-socketname-hidden.yaml")
	out, _, err = runArgs("validate", "--config", invalid)
	if err == nil || exitCode(err) != 1 {
		t.Fatalf("validate %s: err %v (exit %d), want exit 1", invalid, err, exitCode(err))
	}
	if want := invalid + `: drivers[0].socketName: ".nfs.sock": must not start with '.': kubelet ignores hidden files`; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	if out != "" {
		t.Errorf("stdout %q for an invalid file, want nothing", out)
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		nil,
		{"frobnicate"},
		{"validate"},
		{"validate", "--config"},
		{"validate", "--nope", "x"},
		{"validate", "--config", "a.yaml", "extra"},
		{"version", "extra"},
		{"version", "-o", "xml"},
		{"validate", "--config", "a.yaml", "--config", "b.yaml"},
		{"validate", "--config", "a.yaml", "-f", "b.yaml"},
		{"run", "--config", "a.yaml", "-v=-1"},
		{"run", "--config", "a.yaml", "--log-level", "loud"},
		{"run", "--config", "a.yaml", "-v", "1", "--log-level", "warn"},
		{"run", "--config", "a.yaml", "--cleanup-on-exit", "--cleanup-on-exit"},
		{"run", "--config", "a.yaml", "--http-endpoint", "http://127.0.0.1:9809"},
		{"status", "--http-endpoint", "127.0.0.1"},
		{"status", "--http-endpoint", "ftp://127.0.0.1:9809"},
		{"status", "--http-endpoint", ""},
		{"status", "-o", "wide"},
		{"help", "frobnicate"},
	} {
		_, _, err := runArgs(args...)
		var u *usageError
		if !errors.As(err, &u) || exitCode(err) != 2 {
			t.Errorf("multireg %s: err %v (exit %d), want a usage error (exit 2)", strings.Join(args, " "), err, exitCode(err))
		}
	}
	if _, _, err := runArgs("validate", "-h"); err != nil {
		t.Errorf("validate -h: %v, want nil", err)
	}
}

func TestVersion(t *testing.T) {
	out, _, err := runArgs("version")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"multireg ", version, commit, runtime.Version()} {
		if !strings.Contains(out, want) {
			t.Errorf("version output %q lacks %q", out, want)
		}
	}
}

// TestValidateInputs: validate reads a drivers file, standard input, a ConfigMap, and a stream
// of manifests, naming the ConfigMap and key of every problem.
func TestValidateInputs(t *testing.T) {
	testdata := filepath.Join("..", "..", "config", "testdata")
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(testdata, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	summary := ": valid: 3 drivers (1 CSIPlugin, 1 DRAPlugin, 1 DevicePlugin) in /var/lib/kubelet/plugins_registry\n"
	for _, args := range [][]string{{"validate", "-f", "-"}, {"validate", "--filename", "-"}, {"validate", "--config", "-"}, {"validate", "--config=-"}} {
		out, _, err := runStdin(read("valid-full.yaml"), args...)
		if err != nil || out != "<stdin>"+summary {
			t.Errorf("multireg %s < valid-full.yaml: %q, %v; want %q", strings.Join(args, " "), out, err, "<stdin>"+summary)
		}
	}

	_, _, err := runStdin(read("invalid-socketname-hidden.yaml"), "validate", "-f", "-")
	if want := `<stdin>: drivers[0].socketName: ".nfs.sock": must not start with '.': kubelet ignores hidden files`; err == nil || err.Error() != want || exitCode(err) != 1 {
		t.Errorf("an invalid file on stdin: %v (exit %d), want %q (exit 1)", err, exitCode(err), want)
	}

	out, _, err := runStdin(read("manifests/configmap.yaml"), "validate", "-f", "-")
	if want := "<stdin>: ConfigMap kube-system/multireg (document 1 at line 2) data[config.yaml]: valid: 1 driver (1 CSIPlugin) in /var/lib/kubelet/plugins_registry\n"; err != nil || out != want {
		t.Errorf("a ConfigMap: %q, %v; want %q", out, err, want)
	}

	rendered := filepath.Join(testdata, "manifests", "rendered.yaml")
	out, _, err = runArgs("validate", "-f", rendered)
	if want := rendered + ": ConfigMap kube-system/multireg (document 2 at line 11) data[config.yaml]: valid: 1 driver (1 CSIPlugin) in /var/lib/kubelet/plugins_registry\n"; out != want {
		t.Errorf("rendered manifests: stdout %q, want %q", out, want)
	}
	where := rendered + ": ConfigMap gpu/gpu-multireg (document 4 at line 35) data[drivers.yaml]: "
	want := where + `drivers[0].endpoint: "dra.sock": must be an absolute path` + "\n" +
		where + `drivers[1].name: "gpu.example.com": duplicate of drivers[0].name` + "\n" +
		where + `drivers[1].socketName: "gpu.example.com-reg.sock" (default): socket path "/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock" is also used by drivers[0] ("gpu.example.com")`
	if err == nil || err.Error() != want || exitCode(err) != 1 {
		t.Errorf("rendered manifests: err\n%v\n(exit %d), want\n%s\n(exit 1)", err, exitCode(err), want)
	}

	// The chart rendered with its dashboard: the dashboard's ConfigMap carries the chart's labels
	// and holds no drivers file; it is not checked.
	out, _, err = runStdin(read("manifests/dashboard.yaml"), "validate", "-f", "-")
	if want := "<stdin>: ConfigMap kube-system/multireg (document 1 at line 6) data[config.yaml]: valid: 0 drivers in /var/lib/kubelet/plugins_registry\n"; err != nil || out != want {
		t.Errorf("a stream with labelled ConfigMaps that hold no drivers file: %q, %v; want %q", out, err, want)
	}

	_, _, err = runStdin("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other}\n", "validate", "-f", "-")
	if err == nil || exitCode(err) != 1 || !strings.Contains(err.Error(), "no multireg ConfigMap") {
		t.Errorf("manifests without multireg's ConfigMap: %v (exit %d), want exit 1 saying so", err, exitCode(err))
	}
}

// TestHelp: every command's help goes to stdout, with a description and the flags as the docs
// spell them; `help <command>` prints the same; run's help names its signals and exit codes.
func TestHelp(t *testing.T) {
	for _, tt := range []struct {
		cmd  string
		want []string
	}{
		{"run", []string{"Usage:\n  multireg run --config FILE", "  --config FILE ", "  --http-endpoint HOST:PORT ", "  -v N ", "  --log-level LEVEL ", "  --cleanup-on-exit ", "SIGTERM", "SIGHUP", "Exit codes:", "  2   a usage error"}},
		{"validate", []string{"Usage:\n  multireg validate", "  --config, -f, --filename FILE ", "  --key KEY ", "helm template", "Exit codes:"}},
		{"status", []string{"Usage:\n  multireg status", "  --http-endpoint HOST:PORT|URL ", "  -o, --output FORMAT ", "yaml", "Exit codes:"}},
		{"version", []string{"Usage:\n  multireg version", "Print multireg's version", "  -o, --output FORMAT "}},
	} {
		for _, args := range [][]string{{tt.cmd, "--help"}, {tt.cmd, "-h"}, {"help", tt.cmd}} {
			out, errOut, err := runArgs(args...)
			if err != nil || errOut != "" {
				t.Errorf("multireg %s: err %v, stderr %q; want help on stdout only", strings.Join(args, " "), err, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("multireg %s: help lacks %q:\n%s", strings.Join(args, " "), w, out)
				}
			}
			if strings.Contains(out, "\n  -config") || strings.Contains(out, "\n  -http-endpoint") {
				t.Errorf("multireg %s: a long flag with one dash:\n%s", strings.Join(args, " "), out)
			}
		}
	}
	for _, args := range [][]string{{"--help"}, {"help"}, {"-h"}} {
		if out, errOut, err := runArgs(args...); err != nil || errOut != "" || !strings.Contains(out, "Commands:") {
			t.Errorf("multireg %s: %q, %q, %v; want the top-level help on stdout", strings.Join(args, " "), out, errOut, err)
		}
	}
}

// TestErrorsOnce: a command's error is returned once, for main to print, and nothing is
// printed before it.
func TestErrorsOnce(t *testing.T) {
	_, errOut, err := runArgs("validate", "--nope")
	if errOut != "" {
		t.Errorf("stderr %q, want nothing: main prints the error", errOut)
	}
	want := "multireg validate: unknown flag --nope\nRun 'multireg validate --help' for usage."
	if err == nil || err.Error() != want {
		t.Errorf("err %q, want %q", err, want)
	}
}

func TestVersionOutput(t *testing.T) {
	out, _, err := runArgs("version", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var v versionInfo
	if err := json.Unmarshal([]byte(out), &v); err != nil || v.Version != version || v.Commit != commit || v.GoVersion != runtime.Version() || v.Platform != runtime.GOOS+"/"+runtime.GOARCH {
		t.Errorf("version -o json: %q (%v)", out, err)
	}
	out, _, err = runArgs("version", "-o", "yaml")
	if err != nil || !strings.Contains(out, "version: "+version+"\n") || !strings.Contains(out, "goVersion: "+runtime.Version()+"\n") {
		t.Errorf("version -o yaml: %q, %v", out, err)
	}
}

func TestStatusURL(t *testing.T) {
	for _, tt := range []struct{ give, want string }{
		{"127.0.0.1:9809", "http://127.0.0.1:9809/status"},
		{":9809", "http://127.0.0.1:9809/status"},
		{"0.0.0.0:9809", "http://127.0.0.1:9809/status"},
		{"http://127.0.0.1:9809", "http://127.0.0.1:9809/status"},
		{"http://127.0.0.1:9809/", "http://127.0.0.1:9809/status"},
		{"https://proxy.example/nodes/a/multireg", "https://proxy.example/nodes/a/multireg/status"},
	} {
		if got, err := statusURL(tt.give); err != nil || got != tt.want {
			t.Errorf("statusURL(%q) = %q, %v; want %q", tt.give, got, err, tt.want)
		}
	}
}

func TestRunFlagsLogLevel(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want slog.Level
	}{
		{nil, slog.LevelInfo},
		{[]string{"-v", "1"}, slog.LevelDebug},
		{[]string{"-v=2", "--log-level", "debug"}, slog.LevelDebug},
		{[]string{"--log-level", "warn"}, slog.LevelWarn},
		{[]string{"--log-level", "ERROR"}, slog.LevelError},
	} {
		f, err := parseRunFlags(append([]string{"--config", "a.yaml"}, tt.args...), io.Discard, false)
		if err != nil || f.level != tt.want {
			t.Errorf("run %s: level %v, %v; want %v", strings.Join(tt.args, " "), f.level, err, tt.want)
		}
	}
}
