// Package registrar registers kubelet plugins: for each configured driver, a loop serves the
// driver's Registration socket in kubelet's plugins-registry directory, answers kubelet's
// GetInfo, takes its verdict, and publishes the socket anew when kubelet needs it to try again;
// a Supervisor runs the loops of every driver, shares one file watcher among them, and hands
// their sockets to another instance (a hand-over, internal/handover) or takes them from one.
//
// # A driver's loop
//
// A loop is a state machine. In each state it waits for one thing (loop.wake); the event that
// ends the wait moves it to the next state, in step (machine.go), the one place that does. The
// phase /status shows follows the state, except that a driver stays Registered while a
// rollover keeps its previous registration.
//
//	state               waits for                                          phase
//	WaitingForEndpoint  the endpoint to answer (at once without            WaitingForEndpoint
//	                    waitForEndpoint); a socket still served is
//	                    replaced once it does
//	TakingOver          the same, serving sockets a hand-over gave it      as handed over
//	Restarting          the same, kubelet holding cur's registration       Registered
//	                    while its restarted driver comes up
//	FallingBack         the same, back on a rollover's previous            Registered (a device
//	                    registration                                       plugin's: WaitingForEndpoint
//	                                                                       while it does not answer)
//	Publishing          a new generation's socket to be published          Serving
//	AwaitingVerdict     kubelet's verdict on cur, its timeout, or a        Serving
//	                    change of the socket or the endpoint
//	Registered          a change of the socket or the endpoint             Registered
//	BackingOff          the backoff interval, or a blocked path's clearing BackingOff
//	Stopped             nothing: the loop ended
//
// A new driver starts WaitingForEndpoint. A hand-over gives the state to start from:
// TakingOver with the sockets it handed, BackingOff until the next attempt the other instance
// had planned, or WaitingForEndpoint.
//
// Events: EndpointUp (the endpoint answers), EndpointRenamed (a CSI driver answers under another
// name while one of its sockets is served), EndpointDown (its socket went), EndpointRestarted (its socket was created anew: the
// driver restarted), EndpointMoved (another socket matching the endpoint pattern is the one to
// register); Published and PublishFailed; kubelet's verdict, Accepted or Rejected; Timeout (no
// verdict within the registration timeout); SocketGone (the registration socket removed or
// replaced by someone else); DevicesDropped (kubelet dropped a moved device plugin's devices);
// BackoffOver; Reload (a drivers-file edit of loop policy only); Removed (the driver left the
// configuration, or an edit restarts it), Shutdown, HandOff (the sockets go to another
// instance).
//
// Transitions:
//
//	from                event              to                  what the loop does
//	WaitingForEndpoint  EndpointUp         Publishing          publish a generation (over the socket served, if any)
//	WaitingForEndpoint  EndpointUp         Registered          fall back to a rollover's previous registration: its instance is the one to register
//	WaitingForEndpoint  EndpointRenamed    WaitingForEndpoint  withdraw the socket served
//	TakingOver          EndpointUp         Registered          keep the handed registration: the endpoint is the one the other instance probed
//	TakingOver          EndpointUp         AwaitingVerdict     await the verdict kubelet owes the handed socket
//	TakingOver          EndpointUp         Publishing          the driver restarted meanwhile, or a newer instance answers: publish (or roll over)
//	TakingOver          EndpointRenamed    WaitingForEndpoint  withdraw the handed socket
//	Restarting          EndpointUp         Registered          keep the registration: what kubelet learnt of the driver holds (restart.go)
//	Restarting          EndpointUp         Publishing          register again: it changed
//	Restarting          EndpointRenamed    WaitingForEndpoint  withdraw the registration
//	FallingBack         EndpointUp         Registered          keep the previous registration: its instance is the one to register
//	FallingBack         EndpointUp         Publishing          roll over to a newer instance
//	Publishing          Published          AwaitingVerdict     stop serving the socket replaced
//	Publishing          PublishFailed      BackingOff          count the failure
//	AwaitingVerdict     Accepted           Registered          reset the backoff and the timeout; settle a rollover
//	AwaitingVerdict     Rejected           BackingOff          remove the socket: on kubelet 1.35 and older only a new one is tried again
//	AwaitingVerdict     Timeout            BackingOff          remove the socket; the next attempt allows longer
//	AwaitingVerdict     SocketGone         WaitingForEndpoint  publish again, without backoff
//	AwaitingVerdict     EndpointDown       AwaitingVerdict     nothing: the socket stays
//	AwaitingVerdict     EndpointRestarted  WaitingForEndpoint  register again
//	AwaitingVerdict     EndpointMoved      WaitingForEndpoint  register again under the new path
//	AwaitingVerdict     EndpointMoved      FallingBack         withdraw a rollover's new instance: it went, or a newer one came
//	Registered          Accepted           Registered          kubelet registered the socket again: count it
//	Registered          Rejected           BackingOff          remove the socket
//	Registered          SocketGone         WaitingForEndpoint  publish again, without backoff
//	Registered          EndpointDown       Registered          nothing: a crashing driver is not deregistered
//	Registered          EndpointRestarted  Restarting          keep serving while the driver comes up (CSI, DRA)
//	Registered          EndpointRestarted  WaitingForEndpoint  register again (device plugins)
//	Registered          EndpointMoved      WaitingForEndpoint  start a rollover beside the registration, or register again
//	Registered          EndpointMoved      FallingBack         withdraw a rollover's new instance: it went
//	Registered          DevicesDropped     WaitingForEndpoint  register again
//	BackingOff          BackoffOver        WaitingForEndpoint  nothing
//	(any)               Reload             (the same)          take the new loop policy: the next wait follows it
//	(any)               Removed            Stopped             remove the sockets: kubelet deregisters
//	(any)               Shutdown           Stopped             stop serving; the sockets stay, unless cleanup was asked for
//	(any)               HandOff            Stopped             stop serving; the sockets stay, listening, and are handed over
//
// # Rollover
//
// A driver whose endpoint is a pattern starts under a new socket name each time (pattern.go).
// A DRA driver, and a device plugin on a kubelet that keeps several endpoints per resource,
// roll over to a new instance (rollover.go): the new instance is registered through the
// driver's second registration socket while kubelet keeps the previous registration, which is
// withdrawn once the new one is registered and the old instance is gone. A rollover is not a
// state: the loop goes through its states for the new instance's socket while the rollover
// keeps the previous one.
//
// # A DRA driver registered again
//
// Outside a rollover, a DRA driver's new socket never replaces one kubelet may hold: the
// socket served, an earlier run's, or one removed by someone else a moment ago. That one is
// removed first, and the new one is published in a path kubelet no longer holds: the same path
// once kubelet has let go of it (settling), or at once the driver's other path when it has two
// (rollover.go: withdrawsFirst). A socket kubelet rejected is none it holds: the next one
// follows as soon as the backoff allows.
package registrar
