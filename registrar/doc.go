// Package registrar registers kubelet plugins: for each configured driver, a loop serves the
// driver's Registration socket in kubelet's plugins-registry directory, answers kubelet's
// GetInfo, takes its verdict, and publishes the socket anew when kubelet needs it to try again;
// a Supervisor runs the loops of every driver, shares one file watcher among them, and hands
// their sockets to another instance (a hand-over, internal/handover) or takes them over from
// one.
//
// # Where things are
//
//	machine.go       the loop as a state machine: states, events, what each state waits for,
//	                 and the table of transitions that step looks up
//	transitions.go   the acts of the table's rows: everything kubelet can see and every change
//	                 of the loop's state
//	loop.go          the loop's state (one struct) and its run
//	endpoint.go      the driver's endpoint as the loop knows it, and the wait for it to answer;
//	                 pattern.go (an endpoint pattern's matches), health.go (a DRA driver's
//	                 device health services), restart.go (what a driver's restart keeps)
//	await.go         the wait on the socket served: kubelet's verdict, the socket, the endpoint
//	sockets.go       publishing and withdrawing registration sockets, and their paths
//	rollover.go      a registration rolled over to an endpoint's new instance
//	devicemoves.go   a device plugin's move, verified in kubelet's view
//	handover.go      a loop's part in a hand-over: what it hands over, and what it takes over
//	driver.go        what a loop shares with other goroutines: kubelet's verdicts, a new policy
//	status.go        what status shows, the phase derived from the loop's state
//	supervisor.go    the loops of every driver; descriptors.go, kubeletview.go, metrics.go
//
// # A driver's loop
//
// A loop is a state machine. In each state it waits for one thing (machine.go: waits), and
// the wait reports what it saw as an event; the table's row for the state and the event says
// what the loop does (its act: transitions.go) and where it goes. step (machine.go) looks the
// row up: it is the one place that moves a loop, and an act the one place that touches what
// kubelet sees. The phase /status shows is derived from the state (status.go).
//
//	state               waits for                                          phase
//	WaitingForEndpoint  the endpoint to answer (at once without            WaitingForEndpoint
//	                    waitForEndpoint); a socket still served is         (Serving without
//	                    replaced once it does                              waitForEndpoint)
//	TakingOver          the same, serving sockets a hand-over gave it      as handed over
//	Restarting          the same, kubelet holding cur's registration       Registered
//	                    while its restarted driver comes up
//	FallingBack         the same, back on a rollover's previous            Registered (a device
//	                    registration                                       plugin's: WaitingForEndpoint
//	                                                                       while it does not answer)
//	Publishing          the path of the next generation to be free         Serving
//	AwaitingVerdict     kubelet's verdict on cur, its timeout, or a        Serving
//	                    change of the socket or the endpoint
//	Registered          a change of the socket or the endpoint             Registered
//	BackingOff          the backoff interval, or a blocked path's clearing BackingOff
//	Stopped             nothing: the loop ended
//
// While a rollover keeps the previous registration, the phase is Registered whatever the new
// instance's attempt goes through. A new driver starts WaitingForEndpoint. A hand-over gives
// the state to start from: TakingOver with the sockets it handed, BackingOff until the next
// attempt the other instance had planned, or WaitingForEndpoint.
//
// Events: EndpointUp (the endpoint answers), EndpointRenamed (a CSI driver answers under
// another name while one of its sockets is served), EndpointDown (its socket went),
// EndpointRestarted (its socket was created anew: the driver restarted), EndpointMoved (another
// socket matching the endpoint pattern is the one to register); PathFree (the next
// generation's path is free); kubelet's verdict, Accepted or Rejected; Timeout (no verdict
// within the registration timeout); SocketGone (the registration socket removed or replaced by
// someone else); PrevSocketGone and OldInstanceGone (a rollover's previous socket was removed,
// or its old instance is gone); DevicesDropped (kubelet dropped a moved device plugin's
// devices) and MoveVerified (a device plugin's move needs no more checking); BackoffOver;
// Reload (a drivers-file edit of loop policy only); and the end of the loop, by its cause:
// Removed (the driver left the configuration, or an edit registers it anew), Shutdown, HandOver
// (the sockets go to another instance, or to the loop that goes on in this process).
//
// Transitions, as the table in machine.go has them (go generate writes them here):
//
//	from                event              to                  what the loop does
//	WaitingForEndpoint  EndpointUp         Publishing          publish a generation (over the socket served, if any): where, and from when; a DRA driver's sockets kubelet may hold are withdrawn first
//	WaitingForEndpoint  EndpointUp         Registered          fall back to a rollover's previous registration: its instance is the one to register, and kubelet holds it
//	WaitingForEndpoint  EndpointRenamed    WaitingForEndpoint  withdraw the socket served
//	TakingOver          EndpointUp         Registered          keep the handed registration: the endpoint is the one the other instance probed, or what kubelet learnt of it holds
//	TakingOver          EndpointUp         AwaitingVerdict     await the verdict kubelet owes the handed socket
//	TakingOver          EndpointUp         Publishing          the driver restarted meanwhile, or a newer instance answers: publish (or roll over)
//	TakingOver          EndpointUp         TakingOver          nothing: the end of the loop cut the look short, and the next wait sees it
//	TakingOver          EndpointRenamed    WaitingForEndpoint  withdraw the handed socket
//	Restarting          EndpointUp         Registered          keep the registration: what kubelet learnt of the driver holds (restart.go)
//	Restarting          EndpointUp         Publishing          register again: it changed
//	Restarting          EndpointUp         Restarting          nothing: the end of the loop cut the look short, and the next wait sees it
//	Restarting          EndpointRenamed    WaitingForEndpoint  withdraw the registration
//	FallingBack         EndpointUp         Registered          keep the previous registration: its instance is the one to register
//	FallingBack         EndpointUp         Publishing          roll over to a newer instance
//	Publishing          PathFree           AwaitingVerdict     publish the generation; stop serving the socket it replaced (withdraw it, in another path)
//	Publishing          PathFree           BackingOff          the socket could not be published: count the failure
//	AwaitingVerdict     Accepted           Registered          reset the backoff and the timeout; settle a rollover
//	AwaitingVerdict     Rejected           BackingOff          withdraw the socket, which kubelet holds none of: on kubelet 1.35 and older only a new one is tried again
//	AwaitingVerdict     Timeout            BackingOff          withdraw the socket; the next attempt allows longer
//	AwaitingVerdict     SocketGone         WaitingForEndpoint  publish again, without backoff
//	AwaitingVerdict     PrevSocketGone     AwaitingVerdict     end the rollover: kubelet withdrew the previous registration
//	AwaitingVerdict     EndpointDown       AwaitingVerdict     nothing: the socket stays
//	AwaitingVerdict     EndpointRestarted  WaitingForEndpoint  register again
//	AwaitingVerdict     EndpointMoved      WaitingForEndpoint  register again under the new path
//	AwaitingVerdict     EndpointMoved      FallingBack         withdraw a rollover's new instance: it went, or a newer one came
//	AwaitingVerdict     MoveVerified       AwaitingVerdict     end the move's verification
//	Registered          Accepted           Registered          kubelet registered the socket again: count it
//	Registered          Rejected           BackingOff          withdraw the socket, which kubelet holds none of now
//	Registered          SocketGone         WaitingForEndpoint  publish again, without backoff
//	Registered          PrevSocketGone     Registered          end the rollover: kubelet withdrew the previous registration
//	Registered          OldInstanceGone    Registered          withdraw the previous registration: the new one is registered
//	Registered          EndpointDown       Registered          nothing: a crashing driver is not deregistered
//	Registered          EndpointRestarted  Restarting          keep serving while the driver comes up (CSI, DRA)
//	Registered          EndpointRestarted  WaitingForEndpoint  register again (device plugins)
//	Registered          EndpointMoved      WaitingForEndpoint  start a rollover beside the registration, or register again
//	Registered          EndpointMoved      FallingBack         withdraw a rollover's new instance: it went
//	Registered          EndpointMoved      Registered          nothing: the end of the loop cut the look short, and the next wait sees it
//	Registered          DevicesDropped     WaitingForEndpoint  register again, in a path kubelet does not hold
//	Registered          MoveVerified       Registered          end the move's verification
//	BackingOff          BackoffOver        WaitingForEndpoint  nothing
//	(any)               Reload             (the same)          take the new loop policy: a backoff or registration timeout under way is planned anew by it, and every wait from now on follows it
//	(any)               Removed            Stopped             withdraw the sockets: kubelet deregisters
//	(any)               Shutdown           Stopped             stop serving; the sockets stay, unless cleanup was asked for
//	(any)               HandOver           Stopped             stop serving; the sockets stay, listening, and are handed over
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
// withdrawn first, and the new one is published in a path kubelet no longer holds: the same
// path once kubelet has let go of it (settling), or at once the driver's other path when it
// has two (sockets.go: withdrawsFirst, clearPaths). A socket kubelet rejected is
// none it holds: the next one follows as soon as the backoff allows.
package registrar
