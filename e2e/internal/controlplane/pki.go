package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
)

// pki is the cluster's credentials, all made with openssl in dir: a CA, the API server's
// serving certificate for 127.0.0.1/localhost, the API server's client certificate towards
// kubelet (in system:masters), the service-account key pair, and two bearer tokens: an
// admin (system:masters) and kubelet's (system:node:<node> in system:nodes, so that the Node
// authorizer and NodeRestriction judge it as on a real node).
type pki struct {
	dir                      string
	caCert, caKey            string
	serverCert, serverKey    string
	kubeletClientCert        string
	kubeletClientKey         string
	saKey, saPub             string
	tokenFile                string
	adminToken, kubeletToken string
}

func makePKI(ctx context.Context, dir, node string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &pki{
		dir:    dir,
		caCert: filepath.Join(dir, "ca.crt"), caKey: filepath.Join(dir, "ca.key"),
		serverCert: filepath.Join(dir, "apiserver.crt"), serverKey: filepath.Join(dir, "apiserver.key"),
		kubeletClientCert: filepath.Join(dir, "apiserver-kubelet-client.crt"),
		kubeletClientKey:  filepath.Join(dir, "apiserver-kubelet-client.key"),
		saKey:             filepath.Join(dir, "sa.key"), saPub: filepath.Join(dir, "sa.pub"),
		tokenFile: filepath.Join(dir, "tokens.csv"),
	}
	openssl := func(args ...string) error {
		_, err := run(ctx, "openssl", args...)
		return err
	}
	if err := openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p.caKey, "-out", p.caCert,
		"-days", "2", "-subj", "/CN=multireg-e2e-node-ca"); err != nil {
		return nil, err
	}
	if err := p.sign(ctx, "apiserver", "/CN=kube-apiserver",
		"subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n"+
			"extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"); err != nil {
		return nil, err
	}
	if err := p.sign(ctx, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
		"extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"); err != nil {
		return nil, err
	}
	if err := openssl("genrsa", "-out", p.saKey, "2048"); err != nil {
		return nil, err
	}
	if err := openssl("rsa", "-in", p.saKey, "-pubout", "-out", p.saPub); err != nil {
		return nil, err
	}
	p.adminToken, p.kubeletToken = randomToken(), randomToken()
	tokens := fmt.Sprintf("%s,admin,admin,\"system:masters\"\n%s,system:node:%s,kubelet,\"system:nodes\"\n",
		p.adminToken, p.kubeletToken, node)
	if err := os.WriteFile(p.tokenFile, []byte(tokens), 0o600); err != nil {
		return nil, err
	}
	return p, nil
}

// sign makes name.key and name.crt, signed by the CA, with the given subject and
// extensions.
func (p *pki) sign(ctx context.Context, name, subject, ext string) error {
	key, csr, crt := filepath.Join(p.dir, name+".key"), filepath.Join(p.dir, name+".csr"), filepath.Join(p.dir, name+".crt")
	extFile := filepath.Join(p.dir, name+".ext")
	if err := os.WriteFile(extFile, []byte(ext), 0o600); err != nil {
		return err
	}
	if _, err := run(ctx, "openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", subject); err != nil {
		return err
	}
	_, err := run(ctx, "openssl", "x509", "-req", "-in", csr, "-CA", p.caCert, "-CAkey", p.caKey, "-CAcreateserial",
		"-days", "2", "-extfile", extFile, "-out", crt)
	return err
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// kubeconfig writes a kubeconfig for server that authenticates with token.
func kubeconfig(path, server, caCert, token string) error {
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
