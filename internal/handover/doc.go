// Package handover passes the registration directory from the instance that holds it to a
// new one (a DaemonSet's next pod, during a rolling update) without kubelet seeing any change: the
// registration sockets stay the same files, listening all along, and only the process that
// accepts on them changes — what Envoy, HAProxy and nginx do for binary upgrades, across pods
// instead of fork and exec.
//
// This comment is the protocol's specification; Server (holder.go) is the holder's side, Ask
// (ask.go) the new instance's, wire.go the format of the messages (an encoder per version, one
// decoder for all).
//
// # Transport
//
// The holder listens on Name in the registration directory (0600; a leading dot, which kubelet
// ignores; Listen). A new instance that finds the directory's lock held connects there (Dial);
// each side checks that the other runs as its own user (SO_PEERCRED). The exchange is a few
// messages on a SOCK_SEQPACKET connection, each one JSON document (Msg, at most 1 MiB) with its
// descriptors (SCM_RIGHTS):
//
//	new → holder   hello     {minVersion, version}: the range the new instance speaks
//	holder → new   refuse    {reason}                    (the new instance waits for the lock)
//	holder → new   welcome   {version}: the version picked (version 2 on)
//	new → holder   take      {version}                   (version 2 on)
//	holder → new   batch …   {version, drivers, sockets, last, lock, listeners}, with the
//	                         drivers' listening sockets; the last batch also carries the
//	                         holder's listening TCP sockets (listeners, version 2 on) and
//	                         the lock file's descriptor
//	new → holder   ack       {version, listeners}: the listeners taken (or abort {reason})
//	holder → new   released  {version}: the holder has closed its lock descriptor and serves
//	                         nothing
//
// # Versions
//
// Each side speaks a range of versions (minVersion to maxVersion); the holder picks the highest
// both speak, or refuses. A new version is added whenever a message changes in a way a peer of
// an older one would misread; a released version's messages never change. v0.1.0 (commit
// 66a839f) speaks version 1 only, this build versions 1 and 2: a hand-over between the two is
// in version 1, between two of this build in version 2.
//
// Every message after the hello but refuse and abort carries the version picked, and a message
// in another version is a protocol error. Each side writes a message in its version, by that
// version's encoder, and reads every version with one decoder. Versions 1 and 2 differ in
// this, and nothing else:
//
//   - The messages. Version 1: the batches follow the hello at once, and the holder stops its
//     loops on the hello. Version 2 adds welcome and take, so that a hello alone pauses
//     nothing: the holder stops its loops only once the new instance has read the version
//     picked and said take, within Timeouts.Hello of the welcome. A message's keys (type,
//     minVersion, version, reason, drivers, lock, last, sockets) are the same in both;
//     version 2 adds listeners (Listeners, below).
//   - A driver's status. Version 1's has 17 keys, those of v0.1.0's DriverStatus: Name, Type,
//     Phase, Socket, Endpoint, EndpointUp, Absent, Required, Attempts, Failures, Results,
//     Recreations, EndpointRestarts, HeldByOther, LastError, Since, NextAttempt. Name, Type
//     and Required are the spec's; Endpoint is the driver's endpoint (its "endpoint", the
//     spec's Endpoint when that is empty); Results and Recreations are {} when empty.
//     Version 2's has 13: the same without Name, Type, Endpoint and Required. A receiver takes
//     none of those four from the wire, in either version: its own configuration says them
//     (v0.1.0 too replaces them with its own).
//   - A driver's spec. Both have the same 12 keys, the Go field names of v0.1.0's
//     config.Driver: Name, Type, Endpoint, LocalEndpoint, SupportedVersions, SocketName,
//     SocketPath, AltSocketPath, Backoff (InitialInterval, MaxInterval, Multiplier,
//     RandomizationFactor; durations in nanoseconds), RegistrationTimeout (nanoseconds),
//     WaitForEndpoint, Required. Version 1 writes every key always, SupportedVersions null
//     when there are none, as v0.1.0 did: v0.1.0 reads a key not sent as a zero, and serves a
//     handed driver's sockets only when every field but Required equals its own configuration's.
//     Version 2 leaves SupportedVersions out when there are none.
//
// The rest of a batch is the same in both: a driver's spec, endpoint, localEndpoint,
// endpointID {dev, ino, ctimeSec, ctimeNsec}, nodeInfo (base64; left out when none), status,
// timeout (nanoseconds), failures and sockets (left out when none); a socket's prev (left out
// when false), path, id (as endpointID), generation, registered, awaitsVerdict (left out when
// false), endpoint, localEndpoint and versions (left out when none). A last error is cut to
// 4 KiB in both.
//
// testdata/HEAD/protocol-v<N>.json holds the messages this build writes in version N, and
// testdata/v0.1.0/protocol-v1.json those v0.1.0 writes, recorded from v0.1.0 itself; this
// build's version 1 has v0.1.0's keys, key for key (wire_test.go).
//
// # A batch
//
// A batch carries at most 64 drivers and about 64 KiB of JSON (it must fit a SOCK_SEQPACKET
// message whole), and as many descriptors as its drivers have sockets ("sockets"), in order;
// the last batch ("last") carries the lock's descriptor after them ("lock"), and an empty
// batch is sent when there is no driver. A driver comes once: one handed over twice, in one
// batch or in two, is a protocol error, which names it. A driver is its configuration as the
// holder ran it, where its loop stood (status, pacing, the endpoint's identity, a CSI driver's
// NodeGetInfo answer) and its sockets (path, file identity, generation, registered or awaiting
// kubelet's verdict, the versions GetInfo answers). A field a peer does not send takes the
// receiver's own value. The new instance serves a driver's sockets when its own configuration
// registers it as kubelet saw it (Driver.RegistersAs: name, type, endpoint, advertised
// versions, registration socket paths; never the loop's policy), and registers it anew
// otherwise.
//
// # Listeners
//
// In version 2 the last batch carries, after the drivers' sockets and before the lock's, the
// holder's listening TCP sockets: multireg's --http-endpoint ("http"), --health-endpoint
// ("health-http") and --health-grpc-endpoint ("health-grpc"), each named with the address its
// flag gives (ListenerSpec). The new instance takes those whose name and address it serves
// itself, that are listening TCP sockets of its own network namespace (found in
// /proc/self/net/tcp or tcp6: two pods on the host's network share a port, two on the pod
// network do not), and closes the others. Its ack names those it took; the holder, once it
// has released the directory, serves those no more (Holder.Release), and goes on serving any
// other.
//
// # Bounds
//
// A new instance accepts what its own configuration can use (bounds.go), so that a holder that
// hands over more than any sane batch costs it bounded memory, descriptors, reads and log lines:
//
//   - every driver it configures, whole, once;
//   - of the drivers it does not configure (removed from the drivers file by the rollout), as
//     many as it configures, 256 at least, and of each only its sockets' paths, identities and
//     descriptors, to withdraw them once it holds the directory (kubelet deregisters those
//     drivers, as after a reload); of one without sockets, nothing;
//   - two sockets a driver (its current one and a rollover's previous one);
//   - at least one driver in every batch but the last, and 16 KiB of JSON per driver accepted,
//     on average, in all the batches together.
//
// A holder that hands over more is out of protocol: the new instance says abort, closes the
// descriptors of the batch that went beyond at once, and waits for the lock with the batches
// received whole before (Errors); the holder serves again. Once it has exited, the new instance
// removes the sockets it was not handed as it removes those of drivers removed while no
// multireg ran: they are recorded as multireg's (regdir's .multireg.sockets), and nothing
// listens on them any more. No socket of a driver the new instance does not configure stays:
// closing a descriptor without removing its file would leave a dead socket that kubelet dials
// again and again.
//
// It logs one line of what it received and kept, whatever the number of drivers.
//
// # The lock
//
// A flock belongs to the open file, not to a process: once the lock's descriptor is passed,
// both hold the directory until the holder closes its copy, so that it is never free for a
// third instance in between. The new instance locks the descriptor it received before it
// acknowledges (a copy of the holder's open file succeeds; another open of the lock file
// fails), and serves only once told released. Between take (version 1: hello) and released
// the holder's loops are stopped, for Timeouts.Pause at most (the kernel queues kubelet's
// connections on the sockets meanwhile), and its reloader waits; nothing stops before.
//
// # Errors
//
// When anything goes wrong before the ack, the holder keeps the directory — it never let go
// of its open file of the lock — and resumes its loops from what it would have handed over.
// The new instance says abort when it can, lets go of its copy of the lock and waits for the
// lock as a standby, keeping the sockets of every batch it received whole before the error (a
// protocol error in one message costs that message's drivers, not the others'): it serves those
// that are still the files at their paths once it gets the lock (the holder ended), and
// registers the others anew. A new instance that acknowledged and gets no release does the
// same: the holder let go only if it got the ack, and then the lock is free once the new
// instance closed its copy.
//
// The new instance trusts nothing it can check: a socket is served only if the descriptor
// is the socket bound at its path (Socket.Check), only registration sockets of the directory
// are kept (and ever removed), and the lock's descriptor must hold the lock.
//
// # Fault injection
//
// Built with the tag multireg_faults (the end-to-end tests' build; never a release), a process
// reads two variables of its environment: MULTIREG_TEST_HANDOVER_PROTOCOL pins the versions it
// speaks to one (0: none, as a build without hand-overs: it neither listens nor asks), and
// MULTIREG_TEST_HANDOVER_HALT ("<side>:<step>", side holder or new) blocks the hand-over at a
// named step until the process is killed. Without the tag neither is read (nofaults.go).
package handover
