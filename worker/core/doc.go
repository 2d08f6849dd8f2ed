// Package core is the worker's scheduling logic as a deterministic state
// machine: continuous batching of requests over a paged KV cache, with
// admission, chunked prefill under a token budget, preemption by recompute,
// restore of a checkpointed prefix followed by a partial prefill, resumed
// requests ahead of new ones, the checkpoint pages to ship to a holder, live
// migration's stages and the adoption of what they copied, and the load
// statistics the controller's policies read (q_w).
//
// A Core owns no goroutine, channel or clock, and does no I/O: time is an
// input, the engine and the checkpoint store are the caller's. The worker
// daemon (package worker) drives it with the wall clock and a real engine;
// the simulator (package sim) with a virtual clock and a timing profile. The
// two run the same decisions, which is what makes the simulator's figures
// say something about the cluster. The shape is that of etcd-io/raft's
// RawNode: inputs change the state, and the caller collects what the state
// changes ask for.
//
// # Protocol of use
//
// One goroutine owns a Core (it is not safe for concurrent use). It loops:
//
//  1. Feed inputs: Submit for a new call, Cancel for a call whose client
//     went away, HandBack to end every request (shutdown, a rejoin).
//  2. Call Next(now, freePages) with the engine's free KV pages. It admits
//     waiting requests, preempts when the running requests cannot get pages,
//     and returns the Step to run: a batch of engine chunks and, before it,
//     the checkpointed pages to import (Restores).
//  3. Apply Output() — in its order: release the engine sequences in
//     Release (a preemption inside Next frees pages the batch counts on),
//     deliver Events to the requests' streams.
//  4. Import each Restore's pages into its (new, empty) sequence; if one
//     fails, call RestoreFailed and go back to 2.
//  5. Run the batch. On success call Done(now, tokens); on failure call
//     StepFailed(err): when it reports a retry (the engine ran out of pages:
//     a request was preempted) go back to 2 without admitting.
//  6. Apply Output() again: releases, token and error events, checkpoint
//     pages to queue for holders (report a page the queue refused with
//     CheckpointBehind), checkpoint releases, counters and waits.
//
// Live migration (migrate.go) runs between steps too: a source calls
// MigrateOut, then NextStage each time the destination acknowledged the
// previous stage, and CommitOut or AbortOut at the end; a destination calls
// AcceptStage for each stage (and appends its pages to the sequence it
// returns), AbortIn when the source gives up, and Expire when NextExpiry
// comes. Apply Output() after each of them. The request's next call adopts
// the pre-filled sequence in Submit.
//
// An empty Step (no chunks) means nothing can run now. When Stalled, the
// waiting requests need pages or slots that requests stopped for their
// migration's commit or migrations in hold: wait for an input (a call, a
// cancel, a migration's commit, abort or expiry). Otherwise, when the Core
// is not Idle, call Next again (the first call after a squeeze does not
// admit).
// A Step's slices are the Core's and valid until the next Next; an
// Output's until the next call into the Core.
//
// Everything the Core decides depends only on the sequence of calls and
// their arguments: the same calls give the same batches, byte for byte.
// Tests check that the daemon's engine sees exactly the batches a Core
// driven directly computes for the same inputs.
package core
