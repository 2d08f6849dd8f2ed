package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func init() {
	register("status", "show the controller quorum's leader, term and tables", runStatus)
	register("operator raft", "list-peers | remove-peer ID | transfer-leader [ID]", runOperatorRaft)
	register("placement get", "show where a request runs and who holds its checkpoint", runPlacementGet)
	register("workers", "list workers, their phase, drafter pairing and load", runWorkers)
	register("events", "stream the cluster's events (phases, pairings, recovery plans, moves, migrations)", runEvents)
	register("strategy set", "set the recovery strategy ("+policy.StrategyNames()+"), lambda, live migration on|off", runStrategySet)
	register("worker drain", "drain a worker: every request it serves migrates away, then it stops", runWorkerDrain)
	register("migrate", "live-migrate one running request to another worker (-to, or the freest)", runMigrate)
}

// clientFlags are the flags every command that talks to controllers takes.
type clientFlags struct {
	addr    string
	timeout time.Duration
	tls     tlsconf.Files
}

func (c *clientFlags) register(fs *flag.FlagSet) {
	def := os.Getenv("LUMEN_ADDR")
	if def == "" {
		def = "127.0.0.1:7100"
	}
	fs.StringVar(&c.addr, "addr", def, "comma-separated controller gRPC addresses (env LUMEN_ADDR)")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Second, "give up after this long")
	fs.StringVar(&c.tls.Cert, "tls-cert", "", "client certificate (mutual TLS)")
	fs.StringVar(&c.tls.Key, "tls-key", "", "client key")
	fs.StringVar(&c.tls.CA, "tls-ca", "", "CA certificate")
}

func (c *clientFlags) dial() (*ctlclient.Client, context.Context, context.CancelFunc, error) {
	_, clientTLS, err := c.tls.Load()
	if err != nil {
		return nil, nil, nil, err
	}
	cl, err := ctlclient.New([]string{c.addr}, clientTLS)
	if err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	return cl, ctx, func() { cancel(); cl.Close() }, nil
}

// explain turns a gRPC error into a sentence for an operator.
func explain(err error, addr string) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	switch st.Code() {
	case codes.Unavailable:
		return fmt.Errorf("%s (tried %s: is the quorum running? set -addr or LUMEN_ADDR)", st.Message(), addr)
	case codes.NotFound, codes.InvalidArgument, codes.FailedPrecondition:
		return errors.New(st.Message())
	}
	return fmt.Errorf("%s: %s", st.Code(), st.Message())
}

func runStatus(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	cf.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	st, err := cl.ClusterStatus(ctx)
	if err != nil {
		return explain(err, cf.addr)
	}
	fmt.Printf("leader      %s (%s)\nterm        %d\ncommit      %d\napplied     %d (on %s, %s)\nstrategy    %s (lambda %g)\nmigration   %s\nworkers     %d\nplacements  %d\n",
		st.LeaderId, st.LeaderGrpcAddr, st.Term, st.CommitIndex, st.AppliedIndex, st.NodeId, st.State,
		policy.Strategy(st.Strategy), st.Lambda, migrationName(st.Migration), st.Workers, st.Placements)
	return nil
}

func runOperatorRaft(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("operator raft", flag.ContinueOnError)
	cf.register(fs)
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "Usage: lumen operator raft list-peers | remove-peer ID | transfer-leader [ID] [flags]")
		fs.PrintDefaults()
	}
	if len(args) == 0 {
		fs.Usage()
		return errors.New("missing subcommand")
	}
	sub := args[0]
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	switch sub {
	case "list-peers":
		var resp *pb.RaftPeersResponse
		err = cl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
			resp, e = op.RaftPeers(ctx, &pb.RaftPeersRequest{})
			return e
		})
		if err != nil {
			return explain(err, cf.addr)
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tRAFT ADDRESS\tGRPC ADDRESS\tSTATE\tVOTER")
		for _, p := range resp.Peers {
			state := "follower"
			if p.Leader {
				state = "leader"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\n", p.Id, p.Address, p.GrpcAddr, state, p.Suffrage == "Voter")
		}
		tw.Flush()
		fmt.Printf("term %d\n", resp.Term)
	case "remove-peer":
		if fs.NArg() != 1 {
			return errors.New("usage: lumen operator raft remove-peer ID")
		}
		err = cl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
			_, e := op.RemovePeer(ctx, &pb.RemovePeerRequest{Id: fs.Arg(0)})
			return e
		})
		if err != nil {
			return explain(err, cf.addr)
		}
		fmt.Printf("removed %s from the raft configuration\n", fs.Arg(0))
	case "transfer-leader":
		var resp *pb.TransferLeadershipResponse
		err = cl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
			resp, e = op.TransferLeadership(ctx, &pb.TransferLeadershipRequest{Id: fs.Arg(0)})
			return e
		})
		if err != nil {
			return explain(err, cf.addr)
		}
		fmt.Printf("leadership transferred; new leader %s\n", resp.NewLeader)
	default:
		fs.Usage()
		return fmt.Errorf("unknown subcommand %q", sub)
	}
	return nil
}

func runPlacementGet(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("placement get", flag.ContinueOnError)
	cf.register(fs)
	stale := fs.Bool("stale", false, "read from the replica answering, without a quorum round")
	id, rest := splitFirst(args)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if id == "" {
		return errors.New("usage: lumen placement get REQUEST_ID [-stale]")
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	req := &pb.GetPlacementRequest{RequestId: id}
	if *stale {
		req.Consistency = pb.Consistency_CONSISTENCY_STALE
	}
	resp, err := cl.GetPlacement(ctx, req)
	if err != nil {
		return explain(err, cf.addr)
	}
	p := resp.Placement
	holder := p.HolderId
	if holder == "" {
		holder = "(none)"
	}
	state := strings.TrimPrefix(p.State.String(), "PLACEMENT_STATE_")
	if p.State == pb.PlacementState_PLACEMENT_STATE_MIGRATING {
		state += fmt.Sprintf(" to %s (incarnation %d) since %s", p.MigrationTarget, p.MigrationTargetIncarnation,
			time.Unix(0, p.MigrationStartedUnixNano).UTC().Format("15:04:05.000Z"))
	}
	fmt.Printf("request     %s\nworker      %s (incarnation %d)\nholder      %s\nreserved    %d bytes\nstate       %s\nepoch       %d\ntokens      prompt %d, max output %d\nread at     index %d\n",
		p.RequestId, p.WorkerId, p.WorkerIncarnation, holder, p.ReservedBytes, state,
		p.Epoch, p.PromptTokens, p.MaxTokens, resp.AppliedIndex)
	return nil
}

// splitFirst takes a leading positional argument off args.
func splitFirst(args []string) (string, []string) {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		return args[0], args[1:]
	}
	return "", args
}

func runWorkers(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("workers", flag.ContinueOnError)
	cf.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	resp, err := cl.ListWorkers(ctx, &pb.ListWorkersRequest{})
	if err != nil {
		return explain(err, cf.addr)
	}
	loads := map[string]*pb.LoadRecord{}
	for _, l := range resp.Loads {
		loads[l.WorkerId] = l
	}
	migrations := map[string]*pb.WorkerMigrations{}
	for _, m := range resp.Migrations {
		migrations[m.WorkerId] = m
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tINC\tPHASE\tPAIRED\tADDRESS\tQ_W(ms)\tRUNNING\tWAITING\tKV PAGES\tCKPT FREE\tMIGR OUT/IN")
	for _, w := range resp.Workers {
		l := loads[w.Id]
		if l == nil {
			l = &pb.LoadRecord{}
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%.1f\t%d\t%d\t%d/%d\t%d\t%s\n", w.Id, w.Incarnation,
			phaseName(w.Phase), pairedColumn(w), w.GrpcAddr, l.QueueWaitMs, l.Running, l.Waiting,
			l.KvPagesUsed, l.KvPagesTotal, l.FreeCheckpointBytes, migrationsColumn(migrations[w.Id]))
	}
	tw.Flush()
	return nil
}

func runStrategySet(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("strategy set", flag.ContinueOnError)
	cf.register(fs)
	lambda := fs.Float64("lambda", 0, "weight of the restore delay in h(r) (0 keeps the current value)")
	migration := fs.String("migration", "", "live migration for load balance: on or off (empty keeps it; drains migrate either way)")
	replicas := fs.Int("checkpoint-replicas", 0, "copies of each new request's checkpoint, each on a node of its own, none on the serving worker's (1 … "+strconv.Itoa(policy.MaxCheckpointReplicas)+"; 0 keeps the current value; fixed-checkpoint keeps one)")
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "Usage: lumen strategy set [lumen|fixed-checkpoint|stop-and-restart|recompute] [-lambda X] [-migration on|off] [-checkpoint-replicas R] [flags]")
		fmt.Fprintln(os.Stderr, "  stop-and-restart runs an interrupted request again from its prompt (its sent output decoded again);")
		fmt.Fprintln(os.Stderr, "  recompute prefills its prompt and output again and continues (neither keeps checkpoints).")
		fs.PrintDefaults()
	}
	name, rest := splitFirst(args)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if *replicas < 0 || *replicas > policy.MaxCheckpointReplicas {
		return fmt.Errorf("-checkpoint-replicas %d: use 1 … %d (0 keeps the current value)", *replicas, policy.MaxCheckpointReplicas)
	}
	req, err := strategyRequest(name, *lambda, *migration, uint32(*replicas))
	if err != nil {
		return err
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	var resp *pb.SetStrategyResponse
	err = cl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
		resp, e = op.SetStrategy(ctx, req)
		return e
	})
	if err != nil {
		return explain(err, cf.addr)
	}
	if req.Strategy != pb.Strategy_STRATEGY_UNSPECIFIED {
		fmt.Printf("strategy %s (was %s), at index %d\n", policy.Strategy(req.Strategy), policy.Strategy(resp.Previous), resp.Index)
	}
	if req.Migration != pb.MigrationMode_MIGRATION_MODE_UNCHANGED {
		fmt.Printf("live migration for balance %s, at index %d\n", migrationName(req.Migration), resp.Index)
	}
	if req.CheckpointReplicas > 0 {
		fmt.Printf("checkpoint replicas %d, at index %d\n", req.CheckpointReplicas, resp.Index)
	}
	if req.Lambda != 0 && req.Strategy == pb.Strategy_STRATEGY_UNSPECIFIED && req.Migration == pb.MigrationMode_MIGRATION_MODE_UNCHANGED {
		fmt.Printf("lambda %g, at index %d\n", req.Lambda, resp.Index)
	}
	return nil
}

// strategyRequest builds a SetStrategy request from the command's words:
// any of a strategy name, a lambda, a migration switch and a replication
// factor (0: unchanged).
func strategyRequest(name string, lambda float64, migration string, replicas uint32) (*pb.SetStrategyRequest, error) {
	req := &pb.SetStrategyRequest{Lambda: lambda, CheckpointReplicas: replicas}
	if name != "" {
		s, ok := policy.ParseStrategy(name)
		if !ok {
			return nil, fmt.Errorf("unknown strategy %q: use %s", name, policy.StrategyNames())
		}
		req.Strategy = pb.Strategy(s)
	}
	switch migration {
	case "":
	case "on":
		req.Migration = pb.MigrationMode_MIGRATION_MODE_ON
	case "off":
		req.Migration = pb.MigrationMode_MIGRATION_MODE_OFF
	default:
		return nil, fmt.Errorf("-migration %q: use on or off", migration)
	}
	if req.Strategy == pb.Strategy_STRATEGY_UNSPECIFIED && lambda == 0 && req.Migration == pb.MigrationMode_MIGRATION_MODE_UNCHANGED && replicas == 0 {
		return nil, fmt.Errorf("nothing to set: name a strategy (%s), -lambda, -migration on|off or -checkpoint-replicas R", policy.StrategyNames())
	}
	return req, nil
}

func migrationName(m pb.MigrationMode) string {
	if m == pb.MigrationMode_MIGRATION_MODE_ON {
		return "on"
	}
	return "off"
}

// migrationsColumn is a worker's migrations in flight, out/in.
func migrationsColumn(m *pb.WorkerMigrations) string {
	if m == nil {
		return "-"
	}
	return fmt.Sprintf("%d/%d", m.Out, m.In)
}

func runWorkerDrain(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("worker drain", flag.ContinueOnError)
	cf.register(fs)
	follow := fs.Bool("follow", false, "then print the worker's migrations and phase changes until it leaves (Ctrl-C stops watching, not the drain)")
	id, rest := splitFirst(args)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if id == "" {
		return errors.New("usage: lumen worker drain WORKER_ID [-follow]")
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	ws, err := cl.ListWorkers(ctx, &pb.ListWorkersRequest{})
	if err != nil {
		return explain(err, cf.addr)
	}
	var w *pb.Worker
	for _, x := range ws.Workers {
		if x.Id == id {
			w = x
		}
	}
	if w == nil {
		return fmt.Errorf("no worker %q (lumen workers lists them)", id)
	}
	resp, err := cl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: id, Incarnation: w.Incarnation,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "operator drain"})
	if err != nil {
		return explain(err, cf.addr)
	}
	running := uint32(0)
	for _, l := range ws.Loads {
		if l.WorkerId == id {
			running = l.Running
		}
	}
	fmt.Print(drainSummary(w, resp.Worker, running, resp.Index))
	if !*follow {
		return nil
	}
	sctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	phase, err := cl.FollowDrain(sctx, id, resp.Worker.GetIncarnation(), resp.Index, func(ev *pb.Event) { fmt.Println(formatEvent(ev)) })
	if err != nil {
		return nil // interrupted: the drain goes on
	}
	fmt.Printf("worker %s is %s\n", id, phaseName(phase))
	return nil
}

// drainSummary says what a drain does, for the operator who asked.
func drainSummary(before, after *pb.Worker, running uint32, index uint64) string {
	if before.Phase == pb.WorkerPhase_WORKER_PHASE_DRAINING {
		return fmt.Sprintf("worker %s (incarnation %d) was already draining\n", after.Id, after.Incarnation)
	}
	return fmt.Sprintf("worker %s (incarnation %d): %s -> DRAINING at index %d\n"+
		"  it takes no new requests; the leader live-migrates the %d it runs (as of its last load report) to the freest workers,\n"+
		"  a few each round whatever the migration switch says; the worker leaves once it serves none.\n"+
		"  watch: lumen events, lumen workers (MIGR OUT/IN); this command with -follow\n",
		after.Id, after.Incarnation, phaseName(before.Phase), index, running)
}

func runMigrate(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	cf.register(fs)
	to := fs.String("to", "", "destination worker (default: the freest other worker in full service)")
	id, rest := splitFirst(args)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if id == "" {
		return errors.New("usage: lumen migrate REQUEST_ID [-to WORKER]")
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	resp, err := cl.Migrate(ctx, &pb.MigrateRequest{RequestId: id, ToWorker: *to})
	if err != nil {
		return explain(err, cf.addr)
	}
	p := resp.Placement
	fmt.Printf("%s: migrating from %s/%d to %s/%d (epoch %d), at index %d; the source keeps serving it until the destination commits (lumen events)\n",
		p.RequestId, p.WorkerId, p.WorkerIncarnation, p.MigrationTarget, p.MigrationTargetIncarnation, p.Epoch, resp.Index)
	return nil
}

func phaseName(p pb.WorkerPhase) string { return strings.TrimPrefix(p.String(), "WORKER_PHASE_") }

// pairedColumn says whom a worker is paired with in progressive recovery,
// and as what: a drafter (in ASSIST) drafts for its target; a target (in
// full service) verifies its drafter's tokens.
func pairedColumn(w *pb.Worker) string {
	switch {
	case w.PairedWorker == "":
		return "-"
	case w.Phase == pb.WorkerPhase_WORKER_PHASE_ASSIST:
		return "drafts for " + w.PairedWorker
	default:
		return "drafter " + w.PairedWorker
	}
}

func runEvents(args []string) error {
	var cf clientFlags
	fs := flag.NewFlagSet("events", flag.ContinueOnError)
	cf.register(fs)
	from := fs.Int64("from", -1, "print the events after this log index (the replica keeps the last 65,536); -1: only events from now on")
	count := fs.Int("n", 0, "exit after this many events (0: stream until interrupted)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cl, ctx, done, err := cf.dial()
	if err != nil {
		return err
	}
	defer done()
	start := uint64(*from)
	if *from < 0 {
		st, err := cl.ClusterStatus(ctx)
		if err != nil {
			return explain(err, cf.addr)
		}
		start = st.AppliedIndex
	}
	// The stream outlives -timeout, which bounds connecting only.
	sctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	stream, err := cl.WatchEvents(sctx, start)
	if err != nil {
		return explain(err, cf.addr)
	}
	for n := 0; *count == 0 || n < *count; n++ {
		ev, err := stream.Recv()
		if err != nil {
			if sctx.Err() != nil {
				return nil
			}
			if status.Code(err) == codes.OutOfRange {
				return fmt.Errorf("%s: start later (-from) or from now on (-from -1)", status.Convert(err).Message())
			}
			return explain(err, cf.addr)
		}
		fmt.Println(formatEvent(ev))
	}
	return nil
}

// formatEvent is one event in a line: its log index and sequence, the time
// its command was stamped, and what happened.
func formatEvent(ev *pb.Event) string {
	head := fmt.Sprintf("%d.%d  %s  ", ev.Index, ev.Seq, time.Unix(0, ev.UnixNano).UTC().Format("2006-01-02T15:04:05.000Z"))
	why := func(reason string) string {
		if reason == "" {
			return ""
		}
		return " (" + reason + ")"
	}
	switch b := ev.Body.(type) {
	case *pb.Event_PhaseChanged:
		e := b.PhaseChanged
		return head + fmt.Sprintf("phase    %s/%d %s -> %s%s", e.WorkerId, e.Incarnation, phaseName(e.From), phaseName(e.To), why(e.Reason))
	case *pb.Event_Paired:
		e := b.Paired
		if e.Paired {
			return head + fmt.Sprintf("paired   drafter %s/%d drafts for %s/%d%s", e.DrafterId, e.DrafterIncarnation, e.TargetId, e.TargetIncarnation, why(e.Reason))
		}
		return head + fmt.Sprintf("unpaired drafter %s/%d no longer drafts for %s/%d%s", e.DrafterId, e.DrafterIncarnation, e.TargetId, e.TargetIncarnation, why(e.Reason))
	case *pb.Event_RecoveryPlan:
		e := b.RecoveryPlan
		reuse, copies := 0, 0
		for _, a := range e.Assignments {
			if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE {
				reuse++
			}
			if a.MigrationCopy {
				copies++
			}
		}
		line := fmt.Sprintf("recovery plan %d for %s/%d: %d requests, %d reuse a checkpoint, %d recompute",
			e.Id, e.FailedWorker, e.FailedIncarnation, len(e.Assignments), reuse, len(e.Assignments)-reuse)
		if copies > 0 {
			line += fmt.Sprintf(" (%d of the reuses a migration's copy)", copies)
		}
		return head + line
	case *pb.Event_PlacementMoved:
		e := b.PlacementMoved
		p := e.GetPlacement()
		holder := p.GetHolderId()
		if holder == "" {
			holder = "none"
		}
		return head + fmt.Sprintf("moved    %s %s -> %s/%d, holder %s%s", p.GetRequestId(), e.FromWorker, p.GetWorkerId(), p.GetWorkerIncarnation(), holder, why(e.Reason))
	case *pb.Event_StrategyChanged:
		e := b.StrategyChanged
		return head + fmt.Sprintf("strategy %s -> %s", policy.Strategy(e.From), policy.Strategy(e.To))
	case *pb.Event_Migration:
		e := b.Migration
		p := e.GetPlacement()
		stage := strings.ToLower(strings.TrimPrefix(e.Stage.String(), "STAGE_"))
		line := fmt.Sprintf("migrate  %s %s/%d -> %s/%d %s", p.GetRequestId(), e.FromWorker, e.FromIncarnation, e.ToWorker, e.ToIncarnation, stage)
		if e.Stage == pb.Migration_STAGE_COMMITTED {
			holder := p.GetHolderId()
			if holder == "" {
				holder = "none"
			}
			line += fmt.Sprintf(", epoch %d, holder %s", p.GetEpoch(), holder)
		}
		return head + line + why(e.Reason)
	}
	return head + fmt.Sprintf("%v", ev.Body)
}
