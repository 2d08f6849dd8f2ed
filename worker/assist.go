package worker

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// This file is the target's side of progressive recovery: the Assist
// stream a drafter (a restarted worker reloading its model) opens to the
// worker the controller paired it with. The handler hands the drafts to
// the scheduler goroutine, which offers them to the core before each step
// (core.OfferDrafts) and, after each step, leaves the mirror updates and K
// in the session's outbox for the handler to send. Neither side waits for
// the other: a step runs with whatever drafts have arrived, and the
// scheduler never blocks on the stream.

// Limits on an Assist stream (one request's draft line is at most
// core.MaxDraftTokens).
const (
	// maxMirrorBacklog caps the mirrored tokens waiting for a drafter that
	// does not read: past it the stream ends (the drafter is too slow to be
	// of use, and the backlog would grow without bound).
	maxMirrorBacklog = 1 << 20
)

// errAssistBusy refuses a second Assist stream.
var errAssistBusy = errors.New("worker: a drafter already assists this worker; one Assist stream at a time")

// assistSession is one open Assist stream. The scheduler fills the outbox;
// the handler empties it.
type assistSession struct {
	drafter     string
	incarnation uint64

	mu      sync.Mutex // guards ups, k, backlog, err
	ups     []*pb.MirrorUpdate
	k       int
	kSent   int // the K last put in the outbox
	backlog int // tokens in ups
	err     error
	notify  chan struct{} // buffered 1
}

// draftOffer carries a DraftBatch's drafts to the scheduler.
type draftOffer struct {
	sess   *assistSession
	drafts []*pb.DraftTokens
}

// assistCtl attaches a session to the scheduler, or detaches it.
type assistCtl struct {
	sess   *assistSession
	attach bool
}

// push adds updates and K to the outbox; it breaks the session when the
// drafter has fallen too far behind.
func (a *assistSession) push(ups []*pb.MirrorUpdate, k int) {
	a.mu.Lock()
	if a.err != nil || (len(ups) == 0 && k == a.kSent) {
		a.mu.Unlock()
		return
	}
	a.ups = append(a.ups, ups...)
	a.k, a.kSent = k, k
	for _, u := range ups {
		a.backlog += len(u.Tokens)
	}
	if a.backlog > maxMirrorBacklog {
		a.err = status.Errorf(codes.ResourceExhausted, "worker: the drafter fell %d mirrored tokens behind (at most %d); ending the Assist stream", a.backlog, maxMirrorBacklog)
		a.ups = nil
	}
	a.mu.Unlock()
	select {
	case a.notify <- struct{}{}:
	default:
	}
}

// take empties the outbox.
func (a *assistSession) take() (*pb.MirrorBatch, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err != nil {
		return nil, a.err
	}
	mb := &pb.MirrorBatch{Updates: a.ups, K: uint32(a.k)}
	a.ups, a.backlog = nil, 0
	return mb, nil
}

// Assist serves one drafter: it takes the drafter's identity from the
// first DraftBatch, then passes drafts to the scheduler and mirrored
// histories back until either side ends the stream.
func (s *inferenceServer) Assist(stream grpc.BidiStreamingServer[pb.DraftBatch, pb.MirrorBatch]) error {
	w := s.w
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if first.DrafterId == "" {
		return status.Error(codes.InvalidArgument, "the first DraftBatch must name the drafter (drafter_id, drafter_incarnation)")
	}
	if w.isDraining() {
		return status.Error(codes.Unavailable, errDraining.Error())
	}
	if !w.cfg.Engine.Loaded() {
		return status.Errorf(codes.FailedPrecondition, "worker %s is itself loading its model (phase %s): it verifies no drafts",
			w.cfg.ID, phaseName(w.Phase()))
	}
	if w.cfg.Profile == nil && w.cfg.SpecK == 0 {
		return status.Errorf(codes.FailedPrecondition, "worker %s verifies no drafts (SpecK 0, no profile to choose K by)", w.cfg.ID)
	}
	if err := w.checkPairing(stream.Context(), first.DrafterId, first.DrafterIncarnation); err != nil {
		return err
	}
	sess := &assistSession{drafter: first.DrafterId, incarnation: first.DrafterIncarnation, notify: make(chan struct{}, 1), kSent: -1}
	w.mu.Lock()
	if w.assisting != nil {
		busy := w.assisting
		w.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "%v: %s (incarnation %d) does; %s (incarnation %d) was refused",
			errAssistBusy, busy.drafter, busy.incarnation, sess.drafter, sess.incarnation)
	}
	w.assisting = sess
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.assisting = nil
		w.mu.Unlock()
	}()
	select {
	case w.sched.assist <- assistCtl{sess: sess, attach: true}:
	case <-w.sched.done:
		return status.Error(codes.Unavailable, errShutdown.Error())
	}
	defer func() {
		select {
		case w.sched.assist <- assistCtl{sess: sess}:
		case <-w.sched.done:
		}
	}()
	w.metrics.assistStreams.Set(1)
	defer w.metrics.assistStreams.Set(0)
	w.log.Info("a drafter assists this worker", "drafter", sess.drafter, "drafter_incarnation", sess.incarnation)
	defer w.log.Info("the drafter's Assist stream ended", "drafter", sess.drafter)

	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	recvErr := make(chan error, 1)
	go func() { recvErr <- s.recvDrafts(ctx, stream, sess, first) }()
	for {
		select {
		case <-sess.notify:
			mb, err := sess.take()
			if err != nil {
				return err
			}
			if err := stream.Send(mb); err != nil {
				return err
			}
		case err := <-recvErr:
			return err
		case <-w.stop:
			return status.Error(codes.Unavailable, errShutdown.Error())
		}
	}
}

// checkPairing refuses a drafter the controller has not paired with this
// worker: the worker table must name it as this worker's partner, in the
// incarnation it claims. (A worker without controllers takes any drafter.)
func (w *Worker) checkPairing(ctx context.Context, drafter string, incarnation uint64) error {
	if w.ctl == nil {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := w.ctl.ListWorkers(cctx, &pb.ListWorkersRequest{})
	if err != nil {
		return status.Errorf(codes.Unavailable, "worker %s could not read the worker table to check the pairing: %v", w.cfg.ID, err)
	}
	var self, d *pb.Worker
	for _, r := range resp.Workers {
		switch r.Id {
		case w.cfg.ID:
			self = r
		case drafter:
			d = r
		}
	}
	if !core.Paired(d, self) || d.Incarnation != incarnation {
		partner := ""
		if self != nil {
			partner = self.PairedWorker
		}
		return status.Errorf(codes.FailedPrecondition, "the controller has not paired drafter %s (incarnation %d) with worker %s (its partner: %q)",
			drafter, incarnation, w.cfg.ID, partner)
	}
	return nil
}

// recvDrafts reads the drafter's batches (first already read) and hands
// their drafts to the scheduler; nil when the drafter closed the stream.
func (s *inferenceServer) recvDrafts(ctx context.Context, stream grpc.BidiStreamingServer[pb.DraftBatch, pb.MirrorBatch],
	sess *assistSession, first *pb.DraftBatch) error {
	w := s.w
	vocab := int32(w.cfg.Engine.Info().Vocab)
	for b := first; ; {
		for _, d := range b.Drafts {
			if len(d.Tokens) > core.MaxDraftTokens {
				return status.Errorf(codes.InvalidArgument, "draft for %q has %d tokens; at most %d (2K+1 for K up to core.MaxSpecK = %d)",
					d.RequestId, len(d.Tokens), core.MaxDraftTokens, core.MaxSpecK)
			}
			for i, t := range d.Tokens {
				if t < 0 || t >= vocab {
					return status.Errorf(codes.InvalidArgument, "draft for %q: tokens[%d] = %d is not a token id: the vocabulary is [0, %d)", d.RequestId, i, t, vocab)
				}
			}
		}
		if len(b.Drafts) > 0 {
			select {
			case w.sched.drafts <- draftOffer{sess: sess, drafts: b.Drafts}:
			case <-ctx.Done():
				return ctx.Err()
			case <-w.sched.done:
				return status.Error(codes.Unavailable, errShutdown.Error())
			}
		}
		var err error
		if b, err = stream.Recv(); err != nil {
			if errors.Is(err, context.Canceled) || status.Code(err) == codes.Canceled {
				return nil
			}
			return err
		}
	}
}

// --- the scheduler's side (run by its goroutine only) ---

// specConfig is how this worker verifies drafts (core.TargetSpec):
// adaptive K by the profile's cost of the fused step when it has one,
// fixed SpecK otherwise.
func (s *scheduler) specConfig() core.SpecConfig {
	k := s.cfg.SpecK
	if s.cfg.Profile != nil {
		k = 0
	}
	return core.TargetSpec(k, s.cfg.Profile, s.eng.Info().Vocab)
}

func (s *scheduler) assistControl(c assistCtl) {
	switch {
	case c.attach:
		s.sess = c.sess
		s.mirror.Reset()
		s.core.SetSpec(s.specConfig()) // a new drafter: its acceptance is measured afresh
		s.sess.push(s.mirrorUpdates(), s.core.NextK())
	case s.sess == c.sess:
		s.sess = nil
		s.mirror.Reset()
		s.core.SetSpec(core.SpecConfig{})
		s.w.metrics.specK.Set(0)
	}
}

func (s *scheduler) offerDrafts(o draftOffer) {
	if o.sess != s.sess {
		return // a stream that ended
	}
	for _, d := range o.drafts {
		s.core.OfferDrafts(d.RequestId, int(d.Base), d.Tokens)
	}
}

// mirrorUpdates converts the core's mirror updates, copying the tokens:
// the handler reads them on its own goroutine.
func (s *scheduler) mirrorUpdates() []*pb.MirrorUpdate {
	ups := s.mirror.Updates(s.core)
	out := make([]*pb.MirrorUpdate, len(ups))
	for i, u := range ups {
		out[i] = &pb.MirrorUpdate{RequestId: u.ID, From: uint32(u.From), Tokens: append([]int32(nil), u.Tokens...), Ended: u.Ended}
	}
	return out
}

// afterStep tells the drafter, if one assists, what the step committed
// and the K of the step.
func (s *scheduler) afterStep() {
	if s.sess == nil {
		return
	}
	k := s.core.SpecK()
	s.sess.push(s.mirrorUpdates(), k)
	s.w.metrics.specK.Set(float64(k))
	s.w.metrics.specAccept.Set(s.core.Acceptance())
}
