package controlplane

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// PKI is a control plane's credentials, all made with openssl in dir: a CA, the API server's
// serving certificate for 127.0.0.1/localhost (and the kubernetes Service's names and first
// address), the API server's client certificate towards
// kubelet (in system:masters), the service-account key pair, and two bearer tokens: an
// admin (system:masters) and kubelet's (system:node:<node> in system:nodes, so that the Node
// authorizer and NodeRestriction judge it as on a real node).
type PKI struct {
	dir                      string
	CACert, caKey            string
	ServerCert, ServerKey    string
	KubeletClientCert        string
	KubeletClientKey         string
	SAKey, SAPub             string
	TokenFile                string
	AdminToken, KubeletToken string
}

// MakePKI makes the credentials of a control plane whose node is named node, in dir. extraSANs
// are more subject alternative names of the API server's serving certificate, as openssl
// writes them (IP:10.88.77.1, DNS:name): where else its clients reach it.
func MakePKI(ctx context.Context, dir, node string, extraSANs ...string) (*PKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &PKI{
		dir:    dir,
		CACert: filepath.Join(dir, "ca.crt"), caKey: filepath.Join(dir, "ca.key"),
		ServerCert: filepath.Join(dir, "apiserver.crt"), ServerKey: filepath.Join(dir, "apiserver.key"),
		KubeletClientCert: filepath.Join(dir, "apiserver-kubelet-client.crt"),
		KubeletClientKey:  filepath.Join(dir, "apiserver-kubelet-client.key"),
		SAKey:             filepath.Join(dir, "sa.key"), SAPub: filepath.Join(dir, "sa.pub"),
		TokenFile: filepath.Join(dir, "tokens.csv"),
	}
	openssl := func(args ...string) error {
		_, err := run(ctx, "openssl", args...)
		return err
	}
	if err := openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p.caKey, "-out", p.CACert,
		"-days", "2", "-subj", "/CN=multireg-e2e-node-ca"); err != nil {
		return nil, err
	}
	sans := append([]string{"IP:127.0.0.1", "IP:10.0.0.1", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc"}, extraSANs...)
	if err := p.sign(ctx, "apiserver", "/CN=kube-apiserver",
		"subjectAltName="+strings.Join(sans, ",")+"\n"+
			"extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"); err != nil {
		return nil, err
	}
	if err := p.sign(ctx, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
		"extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"); err != nil {
		return nil, err
	}
	if err := openssl("genrsa", "-out", p.SAKey, "2048"); err != nil {
		return nil, err
	}
	if err := openssl("rsa", "-in", p.SAKey, "-pubout", "-out", p.SAPub); err != nil {
		return nil, err
	}
	p.AdminToken, p.KubeletToken = randomToken(), randomToken()
	tokens := fmt.Sprintf("%s,admin,admin,\"system:masters\"\n%s,system:node:%s,kubelet,\"system:nodes\"\n",
		p.AdminToken, p.KubeletToken, node)
	if err := os.WriteFile(p.TokenFile, []byte(tokens), 0o600); err != nil {
		return nil, err
	}
	return p, nil
}

// sign makes name.key and name.crt, signed by the CA, with the given subject and
// extensions.
func (p *PKI) sign(ctx context.Context, name, subject, ext string) error {
	key, csr, crt := filepath.Join(p.dir, name+".key"), filepath.Join(p.dir, name+".csr"), filepath.Join(p.dir, name+".crt")
	extFile := filepath.Join(p.dir, name+".ext")
	if err := os.WriteFile(extFile, []byte(ext), 0o600); err != nil {
		return err
	}
	if _, err := run(ctx, "openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", subject); err != nil {
		return err
	}
	_, err := run(ctx, "openssl", "x509", "-req", "-in", csr, "-CA", p.CACert, "-CAkey", p.caKey, "-CAcreateserial",
		"-days", "2", "-extfile", extFile, "-out", crt)
	return err
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// WriteKubeconfig writes a kubeconfig for server that authenticates with token.
func WriteKubeconfig(path, server, caCert, token string) error {
	return os.WriteFile(path, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: %s
    certificate-authority: %s
users:
- name: e2e
  user:
    token: %s
contexts:
- name: e2e
  context:
    cluster: e2e
    user: e2e
current-context: e2e
`, server, caCert, token)), 0o600)
}

// run runs a command and returns its combined output, or an error that holds it.
func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}
