package ui

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// plansShown is how many of the latest recovery plans the state carries,
// and the requests in recovery are counted over.
const plansShown = 64

// Sample is one point of the charts' history.
type Sample struct {
	UnixMs int64 `json:"t"`
	// Waiting and Running are the workers' queues, summed over their
	// latest load reports (workers in FAILED or LEFT not counted).
	Waiting uint32 `json:"waiting"`
	Running uint32 `json:"running"`
	// QueueWaitMs is the mean of the workers' q_w, QueueWaitMaxMs the
	// largest: the wait from arrival to prefill start, in ms.
	QueueWaitMs    float64 `json:"qwMs"`
	QueueWaitMaxMs float64 `json:"qwMaxMs"`
	// InFlight is the number of placements (requests dispatched and not
	// completed); Recovering those a recovery plan moved that are still in
	// flight.
	InFlight   int `json:"inFlight"`
	Recovering int `json:"recovering"`
	// Workers counts the workers that have not left (FAILED ones
	// included: they are expected back); Serving those in FULL_SERVICE.
	Workers int `json:"workers"`
	Serving int `json:"serving"`
}

// ReplicaStatus is one quorum member as it answered ClusterStatus.
type ReplicaStatus struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raftAddr"`
	GRPCAddr string `json:"grpcAddr"`
	Suffrage string `json:"suffrage"`
	// Reachable: it answered; Error says why not.
	Reachable bool   `json:"reachable"`
	Error     string `json:"error,omitempty"`
	// State is its Raft state (Leader, Follower, Candidate); Leader the
	// leader it knows.
	State        string `json:"state,omitempty"`
	Leader       string `json:"leader,omitempty"`
	Term         uint64 `json:"term"`
	CommitIndex  uint64 `json:"commitIndex"`
	AppliedIndex uint64 `json:"appliedIndex"`
	Self         bool   `json:"self,omitempty"`
}

// LeaderChange is a leadership change this replica saw; Leader is empty
// while it knows none.
type LeaderChange struct {
	Seq    uint64 `json:"seq"`
	UnixMs int64  `json:"t"`
	Leader string `json:"leader"`
	Term   uint64 `json:"term"`
}

// WorkerRow is one worker with its load and the checkpoints it holds.
type WorkerRow struct {
	ID          string `json:"id"`
	Incarnation uint64 `json:"incarnation,string"`
	// Phase is the phase's name without its prefix (FULL_SERVICE, ...).
	Phase         string `json:"phase"`
	PhaseSinceMs  int64  `json:"phaseSince"`
	Addr          string `json:"addr"`
	Model         string `json:"model,omitempty"`
	Draft         string `json:"draft,omitempty"`
	Paired        string `json:"paired,omitempty"`
	ReservedBytes uint64 `json:"reservedBytes"`
	BudgetBytes   uint64 `json:"budgetBytes"`
	// Held is how many placements' checkpoints it holds.
	Held uint32 `json:"held"`
	// Load is its latest load report, when it sent one in this
	// incarnation.
	Load *Load `json:"load,omitempty"`
}

// Load is a worker's latest load report.
type Load struct {
	Running      uint32  `json:"running"`
	Waiting      uint32  `json:"waiting"`
	KVPagesUsed  uint64  `json:"kvUsed"`
	KVPagesTotal uint64  `json:"kvTotal"`
	QueueWaitMs  float64 `json:"qwMs"`
	StoredBytes  uint64  `json:"storedBytes"`
	ReportedMs   int64   `json:"reported"`
}

// Plan is a recovery plan with how far its requests are.
type Plan struct {
	ID                uint64       `json:"id"`
	FailedWorker      string       `json:"failedWorker"`
	FailedIncarnation uint64       `json:"failedIncarnation,string"`
	FailedMs          int64        `json:"failed"`
	Index             uint64       `json:"index"`
	Assignments       []Assignment `json:"assignments"`
}

// Assignment is one request of a plan: where it went and how.
type Assignment struct {
	RequestID string `json:"request"`
	Target    string `json:"target"`
	// Mode is REUSE or RECOMPUTE.
	Mode       string `json:"mode"`
	Holder     string `json:"holder,omitempty"`
	NewHolder  string `json:"newHolder,omitempty"`
	Rebalanced bool   `json:"rebalanced,omitempty"`
	// InFlight: the request has not completed yet.
	InFlight bool `json:"inFlight"`
}

// State is what the page shows, as /ui/api/state and the stream's "state"
// events send it.
type State struct {
	Node      string `json:"node"`
	NodeState string `json:"nodeState"`
	// Leader is the leader this replica knows (empty: none).
	Leader   string  `json:"leader"`
	Term     uint64  `json:"term"`
	Commit   uint64  `json:"commitIndex"`
	Applied  uint64  `json:"appliedIndex"`
	Strategy string  `json:"strategy"`
	Lambda   float64 `json:"lambda"`
	// Quorum is every member of the Raft configuration, polled at
	// QuorumMs (0: not yet).
	Quorum   []ReplicaStatus `json:"quorum"`
	QuorumMs int64           `json:"quorumAt"`
	Workers  []WorkerRow     `json:"workers"`
	// Plans are the latest recovery plans, newest first.
	Plans []Plan `json:"plans"`
	// Sample is the latest sample; History the charts' window, oldest
	// first (sent when a page connects).
	Sample  Sample   `json:"sample"`
	History []Sample `json:"history,omitempty"`
	// Leaders are the leadership changes this replica saw (sent when a
	// page connects; later ones come as "leader" events).
	Leaders []LeaderChange `json:"leaders,omitempty"`
	NowMs   int64          `json:"now"`
}

// state assembles the page's state; full adds the history and the
// leadership changes.
func (d *Dashboard) state(full bool) State {
	r := d.cfg.Replica.Raft()
	f := d.cfg.Replica.FSM()
	_, leader := r.LeaderWithID()
	strategy, lambda := f.Strategy()
	st := State{
		Node: d.cfg.Replica.ID(), NodeState: r.State().String(), Leader: string(leader), Term: term(r),
		Commit: r.CommitIndex(), Applied: f.Applied(),
		Strategy: strings.TrimPrefix(strategy.String(), "STRATEGY_"), Lambda: lambda,
		Workers: workerRows(f), NowMs: time.Now().UnixMilli(),
	}
	st.Plans, _ = plans(f)
	d.mu.Lock()
	defer d.mu.Unlock()
	st.Quorum = d.quorum
	if !d.quorumAt.IsZero() {
		st.QuorumMs = d.quorumAt.UnixMilli()
	}
	if d.n > 0 {
		st.Sample = d.history[(d.next-1+len(d.history))%len(d.history)]
	}
	if full {
		st.History = d.historyLocked()
		st.Leaders = append([]LeaderChange(nil), d.leaders...)
	}
	return st
}

func (d *Dashboard) serveState(w http.ResponseWriter, r *http.Request) {
	d.watch(0)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-cache")
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	_ = enc.Encode(d.state(true))
}

func phaseName(p pb.WorkerPhase) string { return strings.TrimPrefix(p.String(), "WORKER_PHASE_") }

// outOfService: a row that serves nothing and never will again.
func outOfService(p pb.WorkerPhase) bool {
	return p == pb.WorkerPhase_WORKER_PHASE_FAILED || p == pb.WorkerPhase_WORKER_PHASE_LEFT
}

func workerRows(f *fsm.FSM) []WorkerRow {
	t := f.Workers()
	ws, ls, rs := t.Workers, t.Loads, t.Reservations
	loads := make(map[string]*pb.LoadRecord, len(ls))
	for _, l := range ls {
		loads[l.WorkerId] = l
	}
	rows := make([]WorkerRow, len(ws))
	for i, w := range ws {
		rows[i] = WorkerRow{ID: w.Id, Incarnation: w.Incarnation, Phase: phaseName(w.Phase),
			PhaseSinceMs: w.PhaseChangedUnixNano / 1e6, Addr: w.GrpcAddr,
			Model: w.ModelId, Draft: w.DraftId, Paired: w.PairedWorker}
		if i < len(rs) && rs[i].WorkerId == w.Id {
			rows[i].ReservedBytes, rows[i].BudgetBytes, rows[i].Held = rs[i].ReservedBytes, rs[i].BudgetBytes, rs[i].Held
		}
		if l := loads[w.Id]; l != nil && l.Incarnation == w.Incarnation {
			rows[i].Load = &Load{Running: l.Running, Waiting: l.Waiting, KVPagesUsed: l.KvPagesUsed, KVPagesTotal: l.KvPagesTotal,
				QueueWaitMs: l.QueueWaitMs, StoredBytes: l.StoredCheckpointBytes, ReportedMs: l.ReportUnixNano / 1e6}
		}
	}
	return rows
}

// plans returns the latest plansShown recovery plans, newest first, each
// assignment marked in flight or not, and how many requests they moved are
// still in flight (each request counted once).
func plans(f *fsm.FSM) ([]Plan, int) {
	all := f.Recoveries()
	if len(all) > plansShown {
		all = all[len(all)-plansShown:]
	}
	out := make([]Plan, 0, len(all))
	inFlight := map[string]bool{}
	for i := len(all) - 1; i >= 0; i-- {
		rp := all[i]
		p := Plan{ID: rp.Id, FailedWorker: rp.FailedWorker, FailedIncarnation: rp.FailedIncarnation,
			FailedMs: rp.FailedUnixNano / 1e6, Index: rp.Index, Assignments: make([]Assignment, len(rp.Assignments))}
		for k, a := range rp.Assignments {
			// Completed requests leave the placement table.
			pl, _ := f.Placement(a.RequestId)
			live := pl != nil
			if live {
				inFlight[a.RequestId] = true
			}
			p.Assignments[k] = Assignment{RequestID: a.RequestId, Target: a.TargetWorker,
				Mode: strings.TrimPrefix(a.Mode.String(), "RECOVERY_MODE_"), Holder: a.CheckpointHolder,
				NewHolder: a.NewHolder, Rebalanced: a.Rebalanced, InFlight: live}
		}
		out = append(out, p)
	}
	return out, len(inFlight)
}

// sampleTables takes one point of the history from the fsm.
func sampleTables(f *fsm.FSM, now time.Time) Sample {
	s := Sample{UnixMs: now.UnixMilli()}
	t := f.Workers()
	ws, ls := t.Workers, t.Loads
	inService := map[string]uint64{}
	for _, w := range ws {
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
			continue
		}
		s.Workers++
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			s.Serving++
		}
		if !outOfService(w.Phase) {
			inService[w.Id] = w.Incarnation
		}
	}
	reporting := 0
	for _, l := range ls {
		if inc, ok := inService[l.WorkerId]; !ok || inc != l.Incarnation {
			continue
		}
		s.Waiting += l.Waiting
		s.Running += l.Running
		s.QueueWaitMs += l.QueueWaitMs
		s.QueueWaitMaxMs = max(s.QueueWaitMaxMs, l.QueueWaitMs)
		reporting++
	}
	if reporting > 0 {
		s.QueueWaitMs /= float64(reporting)
	}
	_, s.InFlight = f.Counts()
	_, s.Recovering = plans(f)
	return s
}

// pollQuorum asks every member of the Raft configuration for its status,
// at once, each for at most statusTimeout. The member list and their gRPC
// addresses come from this replica's RaftPeers (gossip knows the
// addresses); this replica's own row is read in process.
func pollQuorum(ctx context.Context, cfg Config) []ReplicaStatus {
	self := cfg.Replica
	r := self.Raft()
	f := r.GetConfiguration()
	if f.Error() != nil {
		return nil
	}
	servers := f.Configuration().Servers
	out := make([]ReplicaStatus, len(servers))
	grpcAddrs := peerGRPCAddrs(ctx, cfg)
	var wg sync.WaitGroup
	for i, s := range servers {
		rs := &out[i]
		*rs = ReplicaStatus{ID: string(s.ID), RaftAddr: string(s.Address), Suffrage: s.Suffrage.String(), GRPCAddr: grpcAddrs[string(s.ID)]}
		if rs.ID == self.ID() {
			_, leader := r.LeaderWithID()
			rs.Self, rs.Reachable, rs.GRPCAddr = true, true, self.GRPCAddr()
			rs.State, rs.Leader, rs.Term = r.State().String(), string(leader), term(r)
			rs.CommitIndex, rs.AppliedIndex = r.CommitIndex(), self.FSM().Applied()
			continue
		}
		if rs.GRPCAddr == "" {
			rs.Error = "no gRPC address: gossip does not know it"
			continue
		}
		// The replica's connections close at shutdown: dial none after.
		if ctx.Err() != nil {
			rs.Error = "shutting down"
			continue
		}
		wg.Go(func() { status(ctx, cfg, rs) })
	}
	wg.Wait()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// peerGRPCAddrs asks this replica's own Operator API for the members' gRPC
// addresses, which gossip holds.
func peerGRPCAddrs(ctx context.Context, cfg Config) map[string]string {
	out := map[string]string{}
	if ctx.Err() != nil {
		return out
	}
	cc, err := cfg.Dial(cfg.Replica.GRPCAddr())
	if err != nil {
		return out
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	resp, err := pb.NewOperatorClient(cc).RaftPeers(ctx, &pb.RaftPeersRequest{})
	if err != nil {
		return out
	}
	for _, p := range resp.Peers {
		out[p.Id] = p.GrpcAddr
	}
	return out
}

// status fills rs from the replica's ClusterStatus.
func status(ctx context.Context, cfg Config, rs *ReplicaStatus) {
	cc, err := cfg.Dial(rs.GRPCAddr)
	if err != nil {
		rs.Error = err.Error()
		return
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	st, err := pb.NewOperatorClient(cc).ClusterStatus(ctx, &pb.ClusterStatusRequest{})
	if err != nil {
		rs.Error = err.Error()
		return
	}
	rs.Reachable, rs.State, rs.Leader, rs.Term = true, st.State, st.LeaderId, st.Term
	rs.CommitIndex, rs.AppliedIndex = st.CommitIndex, st.AppliedIndex
	if st.NodeId != rs.ID {
		rs.Error = fmt.Sprintf("%s answers as %q", rs.GRPCAddr, st.NodeId)
	}
}

// term is the replica's current Raft term.
func term(r *raft.Raft) uint64 {
	var t uint64
	fmt.Sscan(r.Stats()["term"], &t)
	return t
}
