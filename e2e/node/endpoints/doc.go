// Package endpoints holds the plugins' own gRPC endpoints for the node e2e tests: a CSI driver,
// a device plugin and a DRA driver, each serving the service a real kubelet calls once multireg
// has registered the plugin, and each recording what the kubelet asked so a test can assert it.
//
// These are the drivers' sockets (the Endpoint of the registration's PluginInfo), never
// registration sockets: registering them with the kubelet is multireg's job.
//
// Every Start function listens on the unix socket path it is given, creating the parent
// directory (0755) if it is missing and replacing a stale socket; it refuses to remove anything
// at the path that is not a socket. Stop stops the server (gracefully for up to one second),
// removes the socket only if it is still the one the endpoint created, and returns after every
// goroutine the endpoint started has exited. Every method is safe for concurrent use.
package endpoints
