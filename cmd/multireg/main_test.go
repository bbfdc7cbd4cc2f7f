package main

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

func runArgs(args ...string) (stdout, stderr string, err error) {
	var out, errOut bytes.Buffer
	err = run(context.Background(), args, &out, &errOut)
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
