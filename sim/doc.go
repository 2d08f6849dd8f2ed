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
// StepTimeK, a restore its ImportTime, a reload its LoadTime; tokens are a
// deterministic function of the request and the output index), the network
// (checkpoint pages cross a link of a given bandwidth, behind a bounded
// queue, as the worker's sender does), Raft's commit latency, failure
// detection (the fast path's probe, a parameter) and the gateway (its
// journal, its placement polling after a broken stream, the resume with
// the token history at the plan's target — under stop-and-restart with the
// prompt alone, the delivered tokens decoded again and suppressed — the
// re-dispatch of a request that had streamed nothing). Each parameter says where its default comes from.
//
// # Progressive recovery with speculation assist
//
// With Config.Speculation (the lumen column; lumen-no-spec is the same
// strategy with the plain reload, the ablation), a killed worker that
// restarts walks its new incarnation through the phases, each a command
// the fsm applies. From the kill, every duration × Timing.ReloadScale
// (ReloadTimeline):
//
//   - at DetectDelay, once MarkFailed is applied, it registers in
//     LOADING_DRAFT (not dispatchable, not a holder);
//   - the draft model (profile qwen3-0.6b-h100) loads in its LoadTime,
//     1.35 s; meanwhile, from the restart, the target's weights are read
//     from disk into host memory (WeightBytes / DiskBytesPerSec: 7.76 s
//     for Qwen3-14B, 17.2 s for 32B);
//   - ASSIST when the draft is loaded: the fsm pairs it with a worker in
//     full service (policy.PairDrafters) and the simulator links the two
//     as the worker's Assist stream does (below); the target's EngineInit
//     (15 s) runs after the disk read;
//   - HOTSWAP at max(draft load, disk + init): only the host-to-GPU copy
//     (WeightBytes / H2DBytesPerSec, 0.84 s for 14B), unpaired;
//   - FULL_SERVICE at max(draft load, disk + init) + H2D, which is
//     Profile.LoadTime (23.6 s for 14B, 34.1 s for 32B): the moment the
//     plain reload serves again. Nothing comes back sooner; the gain is the
//     assist.
//
// The pairing is the fsm's: after every registration, phase change and
// MarkFailed the simulator reads each drafter's row (PairedWorker) and
// links or unlinks; a drafter whose target dies is paired again once the
// failure is applied. While linked, the target's core verifies drafts
// (core.Core.SetSpec: adaptive K by default, its Cost made aware of the
// pipeline by core.PipelinedTokens; Spec.K fixes it) and, after every step, its
// core.Mirror's updates and its K reach the drafter's core.Drafter
// Timing.LinkLatency (100 µs) later; the drafter runs draft steps back to
// back while it has work, each taking the draft profile's StepTime for its
// shape, and its drafts reach the target LinkLatency later
// (core.Core.OfferDrafts). A target step costs Profile.StepTimeK of its
// shape (every decoding row at K+1 positions when any row verifies).
// Unpairing turns speculation off at the target and drops the drafter's
// state.
//
// Draft tokens: the draft model's token at history position pos of request
// r is the true token, token(r, pos − prompt), when a hash of (seed,
// request, pos) falls below α (Spec.Alpha, `lumen sim -spec-alpha`,
// default core.PriorAcceptance = 0.7, docs/calibration.md), else another token:
// deterministic, so a replay of a position never gets a second chance.
// The target samples the true tokens at every verified position, and every
// token a client receives is checked against token(r, index): speculation
// (like failures) provably changes no output.
//
// The spec-k figure (RunSpecK, `lumen sim -figure spec-k`) runs one target
// saturated with long decoding requests and one drafter (Spec.AssistOnly)
// for each α, batch and fixed K, and adaptive K.
//
// # Live migration
//
// With Config.Migration (`lumen sim -migration on`) the fsm's switch is
// set ON and the leader's round runs every Timing.MigrationInterval
// (500 ms, the controller's default, Llumnix's interval), as
// controller.migrationRound does: the FinishMigration aborts of
// fsm.MigrationsStartedBefore (Timing.MigrationTimeout, 10 s), then the
// MigrateCmds of fsm.PlanMigrations, each batch one log entry. A
// migration's source hears it a CommitDelay later and drives its core
// (worker/core's migration API) between its steps, as the daemon's
// sched.do does (worker/migrate.go): MigrateOut, then each NextStage,
// whose pages cross the interconnect in pages × page bytes /
// Timing.InterconnectBytesPerSec (25 GB/s, the worker's -interconnect
// default, the profile's: engine.DefaultInterconnectBytesPerSec), plus
// LinkLatency for the ack, while the source keeps decoding; the
// destination's core takes each stage into its pre-allocation between its
// own steps (AcceptStage, with its free pages) and the ack brings the next
// stage, until the core's last stage stops the request (≤ 16 pages left, or
// stage 3). The source then applies the FinishMigration commit; a
// CommitDelay later the gateway, which follows the COMMITTED event
// (gateway/moves.go), cuts the source's stream and calls the destination
// with the journal's tokens — its core adopts the pre-allocated sequence
// and computes only the next position — and the source's core frees the
// request (CommitOut) between its steps. The client's downtime at the
// switch is mostly the destination's steps: the one in flight when the
// stage and then the call arrive, and the next, which under load carry
// prefill chunks of up to TokenBudget tokens (about 110 ms at 2,048). Every way out that is not
// a commit aborts: the destination refuses a stage (out of pages, its
// running slots full), the request leaves the source (it finished or was
// preempted: core.Output.MigrationsEnded), the leader's stage timeout, a
// killed destination (the source sees its stream break at once), a killed
// source (the fsm's recovery takes the placement; under lumen the
// destination's copy serves as the checkpoint, adopted by the recovered
// call, or reclaimed after core.DefaultMigrationTimeout). Check also finds
// no request stopped for a migration, no pre-allocation and no migration
// under way at the end.
//
// The burst figure (RunBurst, `lumen sim -figure burst`) is issue 15's
// "balance under bursts": Gamma arrivals (workload.Config.CV, 4) at the
// Azure lengths, migration off and on over the same arrivals, 8 and 64
// workers at loads 0.7, 0.85 and 1 of the saturated throughput (measured
// with Poisson arrivals, migration off), 300 s of arrivals: p99 and mean
// TTFT, tokens delivered per second, preemptions, migrations and the
// client's downtime at each switch, against the goals (p99 TTFT at most
// half, throughput within 1%).
//
// The llumnix figure (RunLlumnix, `lumen sim -figure llumnix`) is issue
// 23's reproduction of Llumnix's evaluation: 16 workers of LlamaA10
// (LLaMA-7B on a 24 GB A10), Llumnix's Zipf traces (workload.LlumnixTrace)
// at its rates or near the measured saturation (CalibrateLlumnix), 10,000
// requests a run, vLLM's batch cap and preemption by recompute; the
// columns round-robin (Config.RoundRobin), infaas++ (the freeness
// dispatch, no migration) and lumen (migration on) on the same arrivals.
// Each run also measures every preempted request's loss
// (Result.PreemptionLosses), the fragmentation of the KV memory
// (Result.Fragmentation) and why blocked queue heads stay blocked
// (Result.Blocked); Config.MigrationFilter changes how the simulated
// leader uses the migration policy's plan, for experiments.
//
// # Gateways with lagging views (issue 16)
//
// With Config.Gateways = G > 0 (`lumen sim -gateways G`) the requests are
// placed as issue 16's gateways place them (gateways.go): arrival i goes
// to gateway i mod G, which keeps an internal/placer.Replica — the
// gateway's own code — fed by its WatchLoad stream: fsm.LoadTable every
// Timing.WatchInterval (10 ms, WatchLoad's default; gateway g's ticks
// offset by g/G of it), delivered Timing.WatchDelay (1 ms) after the
// read. The gateway Take()s a worker, the request starts there at once
// (epoch 0, no holder: no commit on the critical path), and its Dispatch,
// naming that worker and incarnation, is applied CommitDelay later: the
// replica then counts it until a table does (Committed), and the worker
// learns h(r) a LinkLatency later (SetHolder: it checkpoints every full
// page from then on). A refusal (fsm.ErrWorkerUnavailable: the worker's
// incarnation failed) cancels the call, Forget()s it, and places the
// request again with another attempt id, excluding every worker that
// refused it, with the journal's tokens; a worker that dies before the commit breaks the
// stream and the gateway waits for the Dispatch's result, then polls as
// before. A Complete is sent only after the Dispatch's result, as on the
// Place stream. Gateways = 0 is the dispatch inside Apply.
//
// GatewayChoice is the placer's own choice, with or without shares:
// ChoosePartitionFill gives each gateway its share (Replica.SetShare), as
// lumen's gateways have theirs from the load table's sessions — gateway g
// prefers the workers at positions ≡ g (mod G) of the table (freeness
// × 1 + placer.ShareBias) after counting, on each other gateway's share, as
// many virtual placements as it has itself that its table does not count;
// ChooseFreest leaves every gateway a lone one (PickServing), the ablation.
//
// The gateways figure (RunGateways, `lumen sim -figure gateways`) runs the
// same Poisson arrivals with the dispatch inside Apply, 1 gateway, 4
// gateways, and 4 choosing by partition-fill, and compares TTFT and the
// spread of running requests across workers (SpreadDefinition: the mean,
// over the queue samples, of the coefficient of variation of each
// worker's running requests) with Apply's, against the goal (within 5%).
//
// A run is a function of its Config: the same Config gives the same events
// in the same order, and the same figures, byte for byte (a test checks
// it). The only wall-clock readings are the optional Apply timings
// (Config.MeasureApply), which measure the real fsm and are kept apart.
//
// At the end of every run Check verifies conservation: every arrival ended
// exactly once (completed or failed), no KV page or checkpoint page or
// reservation is left (nor, with migration, a stopped request or a
// pre-allocation), and no budget was ever exceeded.
package sim
