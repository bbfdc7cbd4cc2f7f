// Package handover passes the registration directory from the instance that holds it to a
// new one (a DaemonSet's next pod, during a rolling update) without kubelet seeing any change: the
// registration sockets stay the same files, listening all along, and only the process that
// accepts on them changes — what Envoy, HAProxy and nginx do for binary upgrades, across pods
// instead of fork and exec.
//
// This comment is the protocol's specification; Server (holder.go) is the holder's side, Ask
// (ask.go) the new instance's, wire.go the format of a batch.
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
//	holder → new   batch …   {version, drivers, sockets, last, lock}, with the drivers'
//	                         listening sockets; the last batch also carries the lock file's
//	                         descriptor
//	new → holder   ack       {version}   (or abort {reason})
//	holder → new   released  {version}: the holder has closed its lock descriptor and serves
//	                         nothing
//
// # Versions
//
// Each side speaks a range of versions (minVersion to maxVersion); the holder picks the highest
// both speak, or refuses. A new version is added whenever a message changes in a way a peer of
// an older one would misread. Version 1 (v0.1.0): the batches follow the hello at once.
// Version 2 adds welcome and take, so that a hello alone pauses nothing: the holder stops its
// loops only once the new instance has read the version picked and said take, within
// Timeouts.Hello of the welcome. Every message after the hello carries the version picked, and
// a message in another version is a protocol error. Both versions have the same batch: its
// drivers' format, key by key, is wire.go's, and testdata/protocol-v<N>.json holds each
// version's messages (version 1's as v0.1.0 sends them).
//
// # A batch
//
// A batch carries at most 64 drivers and about 64 KiB of JSON (it must fit a SOCK_SEQPACKET
// message whole), and as many descriptors as its drivers have sockets ("sockets"), in order;
// the last batch ("last") carries the lock's descriptor after them ("lock"), and an empty
// batch is sent when there is no driver. A driver is its configuration as the holder ran it,
// where its loop stood (status, pacing, the endpoint's identity, a CSI driver's NodeGetInfo
// answer) and its sockets (path, file identity, generation, registered or awaiting kubelet's
// verdict, the versions GetInfo answers). A field a peer does not send takes the receiver's
// own value. The new instance serves a driver's sockets when its own configuration registers
// it as kubelet saw it (Driver.RegistersAs: name, type, endpoint, advertised versions,
// registration socket paths; never the loop's policy), and registers it anew otherwise.
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
