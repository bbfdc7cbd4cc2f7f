// Command cleanup undoes a single-node test cluster whose test binary died before its own
// teardown (killed, timed out): it stops the processes recorded in DIR/state.json that still
// run, unmounts everything below DIR, deletes the bridge, restores the sysctls kubelet
// changed and removes the host files kubelet wrote. It is idempotent; `make e2e-node` runs it
// after every test run.
//
//	go run ./cmd/cleanup DIR
package main

import (
	"fmt"
	"os"

	"multireg.dev/multireg/e2e/node/cluster"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: cleanup DIR")
		os.Exit(2)
	}
	if err := cluster.Cleanup(os.Args[1]); err != nil {
		fmt.Fprintf(os.Stderr, "cleanup %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
