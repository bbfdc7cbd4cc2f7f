package images

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
)

// WriteHostsDir writes, into dir, containerd's configuration of the registry at host
// ("127.0.0.1:PORT", a Registry's Host): dir/HOST/hosts.toml, which says to pull from it over
// plain HTTP. dir is what containerd's CRI plugin takes as its registry `config_path` (the
// hosts.toml format of containerd 1.5 and later; Debian 12 ships 1.6) and `ctr images pull
// --hosts-dir`. Without it containerd would speak HTTPS to any registry but localhost.
func WriteHostsDir(dir, host string) error {
	if _, _, err := net.SplitHostPort(host); err != nil {
		return fmt.Errorf("registry host %q: want HOST:PORT: %w", host, err)
	}
	hostDir := filepath.Join(dir, host)
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		return err
	}
	toml := fmt.Sprintf(`# The e2e test's registry, in the test process: plain HTTP on the loopback.
server = "http://%[1]s"

[host."http://%[1]s"]
  capabilities = ["pull", "resolve"]
`, host)
	return os.WriteFile(filepath.Join(hostDir, "hosts.toml"), []byte(toml), 0o644)
}
