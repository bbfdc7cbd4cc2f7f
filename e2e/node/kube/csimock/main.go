// Command csimock serves Kubernetes' own e2e mock CSI driver
// (k8s.io/kubernetes/test/e2e/storage/drivers/csi-test, the driver kubelet's CSI e2e tests
// use) on a unix socket, with its node, identity and controller services, and logs every
// call it answers as `gRPCCall: {json}` (the driver's own log, klog -v=3) on stderr. Its
// NodeGetInfo answers the driver name as the node ID; NodePublishVolume accepts inline
// ephemeral volumes (csi.storage.k8s.io/ephemeral) without staging or attaching.
package main

import (
	"flag"
	"net"
	"os"
	"os/signal"
	"syscall"

	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/storage/drivers/csi-test/driver"
	"k8s.io/kubernetes/test/e2e/storage/drivers/csi-test/mock/service"
)

func main() {
	endpoint := flag.String("endpoint", "", "unix socket to serve on (replaced if it exists)")
	name := flag.String("name", service.Name, "CSI driver name, also the node ID NodeGetInfo answers")
	klog.InitFlags(nil)
	_ = flag.Set("v", "3")
	flag.Parse()
	if *endpoint == "" {
		klog.Fatal("-endpoint is required")
	}
	svc := service.New(service.Config{DriverName: *name, DisableAttach: true, PermissiveTargetPath: true})
	d := driver.NewCSIDriver(&driver.CSIDriverServers{Controller: svc, Identity: svc, Node: svc})
	if err := os.Remove(*endpoint); err != nil && !os.IsNotExist(err) {
		klog.Fatal(err)
	}
	l, err := net.Listen("unix", *endpoint)
	if err != nil {
		klog.Fatal(err)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	if err := d.Start(l, nil); err != nil {
		klog.Fatal(err)
	}
	klog.Infof("serving %s on %s", *name, *endpoint)
	<-sig
	d.Stop() // closes the listener, which removes the socket
	klog.Infof("stopped")
}
