// Package fsm is lumen's replicated state machine: the workers, load,
// placement and recovery tables that every controller replica holds, and the
// commands that change them.
//
// Contract (as raft.FSM states it, and more strictly):
//
//   - Apply depends on the log entry alone. It never reads a clock (the leader
//     stamps each command), a random source or the network, and never
//     iterates a map: two replicas fed the same log hold byte-identical
//     snapshots. (It times each command for the apply-duration metric;
//     that reading never reaches the state.)
//   - Decisions that depend on the tables — the serving worker, the checkpoint
//     holder, the recovery plan — are computed here by the policy package, so
//     they are made once, at a log index, identically everywhere, and the
//     reserved checkpoint footprint moves atomically with the placement.
//   - A log entry that will not decode panics the replica: the log is the
//     truth and a replica that cannot read it must not serve. An operation
//     that is rejected (unknown worker, stale incarnation) is a returned
//     Result, surfaced by the controller as a gRPC status.
//   - Stored table rows are never mutated after they are stored; a change
//     stores a new row. That keeps Snapshot cheap (it copies pointers) and
//     lets Persist run concurrently with Apply.
//
// Apply and Snapshot are called from raft's FSM goroutine; readers call the
// query methods concurrently, under FSM.mu.
package fsm
