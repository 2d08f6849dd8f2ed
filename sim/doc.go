// Package sim is lumen's discrete-event cluster simulator: N workers, each
// running the worker's own scheduling core (worker/core) on a virtual clock
// with the costs of a timing profile (worker/engine.Profile), under the
// controller's own replicated state machine (fsm), which makes every
// decision through policy — dispatch, the checkpoint holder h(r), the
// recovery plan — exactly as in the cluster: the simulator feeds it the
// commands the controller would propose, stamped with virtual time, as
// Raft log entries. Nothing that decides is re-implemented here.
//
// What is modelled rather than run: the engine (a step takes the profile's
// StepTime, a restore its ImportTime, a reload its LoadTime; tokens are a
// deterministic function of the request and the output index), the network
// (checkpoint pages cross a link of a given bandwidth, behind a bounded
// queue, as the worker's sender does), Raft's commit latency, failure
// detection (the fast path's probe, a parameter) and the gateway (its
// journal, its placement polling after a broken stream, the resume with
// the token history at the plan's target, the re-dispatch of a request that
// had streamed nothing). Each parameter says where its default comes from.
//
// A run is a function of its Config: the same Config gives the same events
// in the same order, and the same figures, byte for byte (a test checks
// it). The only wall-clock readings are the optional Apply timings
// (Config.MeasureApply), which measure the real fsm and are kept apart.
//
// At the end of every run Check verifies conservation: every arrival ended
// exactly once (completed or failed), no KV page or checkpoint page or
// reservation is left, and no budget was ever exceeded.
package sim
