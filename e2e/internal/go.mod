// Module internal holds what the end-to-end modules share (this one, e2e/node): the runner of
// child processes and the polls. It needs nothing but the standard library, so that requiring
// it adds nothing to their dependency graphs.
module multireg.dev/multireg/e2e/internal

go 1.26
