package core

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// The migration tests drive two Cores, each over its own synthetic engine,
// as the worker daemons do: the source's stages are exported from its
// engine and appended to the destination's, decoding going on between
// them; the "gateway" resumes the request at the destination with the
// tokens it streamed.

// copyStage exports st's pages from the source's engine and hands them to
// the destination; it returns the destination's refusal.
func copyStage(t *testing.T, src, dst *harness, st MigrationStage) error {
	t.Helper()
	var pages [][]byte
	for i := range st.Hashes {
		p, err := src.eng.ExportPage(st.Seq, st.First+i)
		if err != nil {
			t.Fatalf("export page %d of stage %d: %v", st.First+i, st.Stage, err)
		}
		pages = append(pages, p)
	}
	var tail []byte
	if st.Last {
		var n int
		var err error
		tail, n, err = src.eng.ExportTail(st.Seq)
		if err != nil || n != st.Tail {
			t.Fatalf("tail of %d positions (%v), the stage says %d", n, err, st.Tail)
		}
	}
	seq, err := dst.c.AcceptStage(dst.now, IncomingStage{ID: st.ID, Epoch: st.Epoch, Stage: st.Stage, First: st.First,
		Hashes: st.Hashes, Last: st.Last, Tail: st.Tail, History: st.History, Holder: st.Holder, Checkpointed: st.Checkpointed, Hold: st.Hold},
		dst.eng.FreePages())
	dst.apply()
	if err != nil {
		return err
	}
	if err := dst.eng.AppendPages(seq, pages, tail, st.Tail); err != nil {
		t.Fatalf("append stage %d: %v", st.Stage, err)
	}
	return nil
}

// migration runs request id's migration from src to dst under epoch, with
// between steps of decoding on the source between stages, and returns the
// stages taken. It stops after the last stage's copy (before the commit)
// or at the first refusal, which it returns.
func migration(t *testing.T, src, dst *harness, id string, epoch uint64, between int) ([]MigrationStage, error) {
	t.Helper()
	if err := src.c.MigrateOut(id, epoch); err != nil {
		t.Fatal(err)
	}
	var stages []MigrationStage
	for {
		st, err := src.c.NextStage(id, epoch)
		src.apply()
		if err != nil {
			t.Fatal(err)
		}
		stages = append(stages, st)
		if err := copyStage(t, src, dst, st); err != nil {
			return stages, err
		}
		if st.Last {
			return stages, nil
		}
		for range between {
			src.step()
			dst.step()
		}
		if m, _ := src.c.Migrating(id); !m {
			return stages, errors.New("the request left the source")
		}
	}
}

// resume is the gateway's call at the destination after the move: the
// tokens streamed so far, the newer epoch; topLogprobs ≥ 0 asks for
// logprobs.
func resume(dst *harness, id string, p []int32, streamed []int32, maxTokens int, epoch uint64, topLogprobs ...int) *Request {
	r := &Request{ID: id, Epoch: epoch, History: append(slices.Clone(p), streamed...), Prompt: len(p), MaxTokens: maxTokens,
		Arrived: dst.now}
	if len(topLogprobs) > 0 {
		r.Logprobs, r.TopLogprobs = true, topLogprobs[0]
	}
	dst.c.Submit(r)
	dst.apply()
	return r
}

func (h *harness) checkAllFree(t *testing.T, what string) {
	t.Helper()
	if free, total := h.eng.FreePages(), h.eng.Info().TotalPages; free != total || h.c.CachedPages() != 0 {
		t.Errorf("%s: %d of %d engine pages free, the core counts %d cached", what, free, total, h.c.CachedPages())
	}
}

// TestMigrationStages: stage 1 sends every full page, each next one the
// pages filled since; the stop-and-copy comes when few enough pages remain
// or at the last allowed stage, and carries the partial page and the
// history. The source stops the request at the last stage and frees it
// only at the commit; the destination's first step for it is one decode.
func TestMigrationStages(t *testing.T) {
	seed := uint64(31)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	p := prompt(rng, 600) // 37 full pages and 8 positions after the prefill
	cases := []struct {
		name      string
		stopPages int
		between   int // source steps between stages
		want      []string
	}{
		// 38 pages remain before stage 1: more than 16. 20 decodes later
		// 39 pages hold 620 positions: 2 remain, the stop-and-copy.
		{"two stages", 16, 20, []string{"1:0+37", "2:37+1 tail 12 last"}},
		// With a stop at 1 page the third stage is the last anyway.
		{"three stages at most", 1, 20, []string{"1:0+37", "2:37+1", "3:38+2 last"}},
		// Short enough at once: stage 1 is the stop-and-copy.
		{"stop at once", 64, 0, []string{"1:0+37 tail 8 last"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Self: "w1", MigrationStopPages: tc.stopPages}
			src := newHarness(t, 128, cfg, nil)
			dst := newHarness(t, 128, Config{Self: "w2", MigrationStopPages: tc.stopPages}, nil)
			ref := reference(t, p, 80)
			src.submit("x", p, nil, 80)
			src.step()
			src.step()
			stages, err := migration(t, src, dst, "x", 0, tc.between)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, st := range stages {
				s := fmt.Sprintf("%d:%d+%d", st.Stage, st.First, len(st.Hashes))
				if st.Tail > 0 {
					s += fmt.Sprintf(" tail %d", st.Tail)
				}
				if st.Last {
					s += " last"
				}
				got = append(got, s)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("stages %q, want %q", got, tc.want)
			}
			last := stages[len(stages)-1]
			// Stopped: no more steps for it, its pages held until the commit.
			if src.step() || src.c.Running() != 0 || src.c.CachedPages() != PagesFor(last.Fed) {
				t.Fatalf("the stopped request still runs: %d running, %d cached pages", src.c.Running(), src.c.CachedPages())
			}
			if !slices.Equal(last.History[len(p):], src.out["x"]) {
				t.Fatal("the last stage's history is not what the source streamed")
			}
			if !src.c.CommitOut("x", 0) {
				t.Fatal("commit refused")
			}
			src.apply()
			if !errors.Is(src.errs["x"], ErrMigrated) {
				t.Fatalf("the source's stream ended with %v, want ErrMigrated", src.errs["x"])
			}
			src.checkAllFree(t, "source after the commit")
			streamed := src.out["x"]
			resume(dst, "x", p, streamed, 80, 1)
			dst.run()
			if dst.batches[len(dst.batches)-(80-len(streamed))] != fmt.Sprintf("x:%d+1/1", last.Fed) {
				t.Fatalf("the destination's first step for the request is %q, want a single decode at %d",
					dst.batches[len(dst.batches)-(80-len(streamed))], last.Fed)
			}
			if got := append(slices.Clone(streamed), dst.out["x"]...); !slices.Equal(got, ref) {
				t.Fatalf("output %v, want %v", got, ref)
			}
			if dst.total.RecomputedTokens != 0 {
				t.Fatalf("%d tokens recomputed at the destination", dst.total.RecomputedTokens)
			}
			dst.checkAllFree(t, "destination at the end")
		})
	}
}

// TestMigrationOutputsMatchTheReference: requests migrate one after the
// other while both workers run their own, with random decoding between
// stages; the gateway sometimes missed the source's last tokens (its
// stream was cut by the move event first). Every output is the reference,
// no token twice, and every page is free at the end.
func TestMigrationOutputsMatchTheReference(t *testing.T) {
	seed := uint64(37)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	src := newHarness(t, 96, Config{Self: "w1", TokenBudget: 64, MaxRunning: 6}, nil)
	dst := newHarness(t, 96, Config{Self: "w2", TokenBudget: 64, MaxRunning: 12}, nil)
	want := map[string][]int32{}
	prompts := map[string][]int32{}
	maxTok := map[string]int{}
	for i := range 6 {
		for _, h := range []*harness{src, dst} {
			id := fmt.Sprintf("%s-%d", h.c.cfg.Self, i)
			p, n := prompt(rng, 20+rng.IntN(200)), 30+rng.IntN(60)
			prompts[id], maxTok[id], want[id] = p, n, reference(t, p, n)
			h.submit(id, p, nil, n)
		}
	}
	// gw is what the gateway got from the source of each migrated request.
	gw := map[string][]int32{}
	var lpIDs []string
	lacked := 0 // of them, resumed lacking tokens the source computed
	for i := range 6 {
		id := fmt.Sprintf("w1-%d", i)
		for range 3 + rng.IntN(10) {
			src.step()
			dst.step()
		}
		if src.c.Lookup(id) == nil {
			continue // finished on the source
		}
		if _, err := migration(t, src, dst, id, 0, rng.IntN(6)); err != nil {
			// The request runs on at the source, untouched.
			t.Logf("%s: migration aborted: %v", id, err)
			src.c.AbortOut(id, 0)
			src.apply()
			continue
		}
		src.c.CommitOut(id, 0)
		src.apply()
		// The move event may cut the gateway's stream before the
		// source's last tokens reached it: they come from the migrated
		// history at the destination.
		streamed := src.out[id]
		streamed = streamed[:len(streamed)-rng.IntN(min(3, len(streamed))+1)]
		gw[id] = slices.Clone(streamed)
		if i%2 == 0 {
			// Asking for logprobs: the tokens the gateway lacks are
			// computed again at the destination, with their logprobs.
			resume(dst, id, prompts[id], streamed, maxTok[id], 1, 3)
			lpIDs = append(lpIDs, id)
			if len(streamed) < len(src.out[id]) {
				lacked++
			}
		} else {
			resume(dst, id, prompts[id], streamed, maxTok[id], 1)
		}
	}
	src.run()
	dst.run()
	for id, w := range want {
		var out []int32
		switch {
		case strings.HasPrefix(id, "w2"):
			out = dst.out[id]
		case gw[id] != nil:
			out = append(gw[id], dst.out[id]...)
		default:
			out = src.out[id]
		}
		if !slices.Equal(out, w) {
			t.Errorf("%s: output %v, want %v", id, out, w)
		}
	}
	if len(gw) < 3 {
		t.Errorf("only %d of 6 migrations committed", len(gw))
	}
	for _, id := range lpIDs {
		ref := referenceLogprobs(t, prompts[id], maxTok[id], 3)[len(gw[id]):]
		got := dst.lps[id]
		if len(got) != len(ref) {
			t.Fatalf("%s: %d tokens with logprobs at the destination, want %d", id, len(got), len(ref))
		}
		for j := range got {
			if got[j] == nil || !reflect.DeepEqual(*got[j], ref[j]) {
				t.Fatalf("%s: token %d's logprobs %v, reference %+v", id, len(gw[id])+j, got[j], ref[j])
			}
		}
	}
	if len(lpIDs) == 0 || lacked == 0 {
		t.Errorf("%d migrated requests asked for logprobs, %d of them lacking tokens: the test does not exercise their recomputation", len(lpIDs), lacked)
	}
	for id, err := range src.errs {
		if !errors.Is(err, ErrMigrated) {
			t.Errorf("%s ended on the source with %v", id, err)
		}
	}
	for id, err := range dst.errs {
		t.Errorf("%s ended on the destination with %v", id, err)
	}
	src.checkAllFree(t, "source")
	dst.checkAllFree(t, "destination")
}

// TestMigrationAborts: each way a migration ends without a move leaves the
// request running where it was with the reference output, and every page
// free on both sides at the end.
func TestMigrationAborts(t *testing.T) {
	seed := uint64(41)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	p := prompt(rng, 300) // 18 full pages and 12 positions
	ref := reference(t, p, 60)
	setup := func(t *testing.T, dstPages int, maxTokens int) (src, dst *harness) {
		src = newHarness(t, 128, Config{Self: "w1", MigrationStopPages: 4}, nil)
		dst = newHarness(t, dstPages, Config{Self: "w2", MigrationStopPages: 4, MigrationTimeout: time.Second}, nil)
		src.submit("x", p, nil, maxTokens)
		src.step()
		return src, dst
	}
	stage := func(t *testing.T, src, dst *harness) (MigrationStage, error) {
		t.Helper()
		st, err := src.c.NextStage("x", 0)
		src.apply()
		if err != nil {
			t.Fatal(err)
		}
		return st, copyStage(t, src, dst, st)
	}
	finishAtSource := func(t *testing.T, src, dst *harness) {
		t.Helper()
		src.run()
		dst.run()
		if !slices.Equal(src.out["x"], ref[:len(src.out["x"])]) || len(src.out["x"]) == 0 {
			t.Fatalf("output %v, want a prefix of %v", src.out["x"], ref)
		}
		if err := src.errs["x"]; err != nil {
			t.Fatalf("the request ended with %v", err)
		}
		src.checkAllFree(t, "source")
		dst.checkAllFree(t, "destination")
	}

	t.Run("the request finishes during the migration", func(t *testing.T) {
		src, dst := setup(t, 128, 10)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		if st, err := stage(t, src, dst); err != nil || st.Last {
			t.Fatalf("stage 1: last %v, %v", st.Last, err)
		}
		for src.c.Lookup("x") != nil {
			src.step()
		}
		if len(src.ended) != 1 || src.ended[0] != (MigrationEnd{ID: "x", Epoch: 0, Why: "the request finished"}) {
			t.Fatalf("migrations ended %+v, want x's: the request finished", src.ended)
		}
		// The source tells the destination, which frees the pre-allocation.
		if !dst.c.AbortIn("x", 0) {
			t.Fatal("no pre-allocation to abort")
		}
		dst.apply()
		finishAtSource(t, src, dst)
	})

	t.Run("the destination is out of pages", func(t *testing.T) {
		src, dst := setup(t, 12, 60)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		if _, err := stage(t, src, dst); !errors.Is(err, ErrMigrationOutOfPages) {
			t.Fatalf("18 pages into 12: %v", err)
		}
		dst.checkAllFree(t, "destination after the refusal")
		src.c.AbortOut("x", 0)
		src.apply()
		finishAtSource(t, src, dst)
	})

	t.Run("the destination dies after the last stage", func(t *testing.T) {
		src, dst := setup(t, 128, 60)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		for {
			st, err := stage(t, src, dst)
			if err != nil {
				t.Fatal(err)
			}
			if st.Last {
				break
			}
			src.step()
		}
		if src.c.Running() != 0 {
			t.Fatal("the request runs after the last stage")
		}
		dst = newHarness(t, 128, Config{Self: "w3"}, nil) // the destination is gone
		src.c.AbortOut("x", 0)
		src.apply()
		finishAtSource(t, src, dst)
	})

	t.Run("the source dies after stage 1", func(t *testing.T) {
		src, dst := setup(t, 128, 60)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		st, err := stage(t, src, dst)
		if err != nil || st.Last {
			t.Fatalf("stage 1: last %v, %v", st.Last, err)
		}
		for range 5 {
			src.step()
		}
		// A recovery places the request at the destination, which resumes
		// it from the pages it got (a checkpoint) and prefills the rest.
		streamed := src.out["x"]
		resume(dst, "x", p, streamed, 60, 1)
		dst.run()
		if got := append(slices.Clone(streamed), dst.out["x"]...); !slices.Equal(got, ref) {
			t.Fatalf("output %v, want %v", got, ref)
		}
		if dst.total.RestoredPages != 18 || dst.total.RecomputedTokens != len(p)+len(streamed)-18*16 {
			t.Fatalf("reused %d pages, recomputed %d tokens; want 18 and %d", dst.total.RestoredPages, dst.total.RecomputedTokens,
				len(p)+len(streamed)-18*16)
		}
		dst.checkAllFree(t, "destination")
	})

	t.Run("a pre-allocation with no next stage is reclaimed", func(t *testing.T) {
		src, dst := setup(t, 128, 60)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		if _, err := stage(t, src, dst); err != nil {
			t.Fatal(err)
		}
		at, ok := dst.c.NextExpiry()
		if !ok || !at.Equal(dst.now.Add(time.Second)) {
			t.Fatalf("expiry %v (%v), want a second after the stage", at, ok)
		}
		if dst.c.Expire(at.Add(-time.Nanosecond)) != 0 {
			t.Fatal("reclaimed before the timeout")
		}
		if dst.c.Expire(at) != 1 {
			t.Fatal("not reclaimed at the timeout")
		}
		dst.apply()
		dst.checkAllFree(t, "destination after the reclaim")
		src.step()
		if _, err := stage(t, src, dst); !errors.Is(err, ErrUnknownMigration) {
			t.Fatalf("a stage after the reclaim: %v", err)
		}
		src.c.AbortOut("x", 0)
		src.apply()
		finishAtSource(t, src, dst)
	})

	t.Run("a stale epoch and a call of the migration's epoch", func(t *testing.T) {
		_, dst := setup(t, 128, 60)
		in := IncomingStage{ID: "y", Epoch: 5, Stage: 1}
		if _, err := dst.c.AcceptStage(dst.now, in, 128); err != nil {
			t.Fatal(err)
		}
		in.Epoch = 3
		if _, err := dst.c.AcceptStage(dst.now, in, 128); !errors.Is(err, ErrStaleEpoch) {
			t.Fatalf("an older migration's first stage: %v", err)
		}
		// A call of the migration's own epoch does not take the pages.
		resume(dst, "y", p[:20], nil, 3, 5)
		if dst.c.Incoming() != 1 {
			t.Fatal("a call of the migration's epoch adopted its pre-allocation")
		}
		dst.run()
		dst.c.Expire(dst.now.Add(time.Hour))
		dst.apply()
		dst.checkAllFree(t, "destination")
	})

	t.Run("preemption and cancellation end a migration", func(t *testing.T) {
		src, _ := setup(t, 128, 60)
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		if err := src.c.MigrateOut("x", 0); !errors.Is(err, ErrMigrating) {
			t.Fatalf("a second migration: %v", err)
		}
		src.c.preempt()
		o := src.c.Output()
		if len(o.MigrationsEnded) != 1 || o.MigrationsEnded[0].Why != "the request was preempted" {
			t.Fatalf("ended %+v", o.MigrationsEnded)
		}
		for _, s := range o.Release {
			src.eng.Release(s)
		}
		src.step()
		if err := src.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		for last := false; !last; {
			st, err := src.c.NextStage("x", 0)
			if err != nil {
				t.Fatal(err)
			}
			last = st.Last
		}
		src.c.Cancel(src.c.Lookup("x"))
		o = src.c.Output()
		if len(o.MigrationsEnded) != 1 || o.MigrationsEnded[0].Why != "the call was cancelled" || len(o.Release) != 1 {
			t.Fatalf("ended %+v, released %v", o.MigrationsEnded, o.Release)
		}
		for _, s := range o.Release {
			src.eng.Release(s)
		}
		src.checkAllFree(t, "source")
	})
}

// TestStoppedRequestKeepsItsCheckpoint: a request stopped for its
// migration's commit whose call is cut (the gateway switched to the
// destination on the commit's event) leaves its holder's pages alone: the
// request goes on at the destination with them. A migrating request that
// still runs releases them when its client goes away, as any request does.
func TestStoppedRequestKeepsItsCheckpoint(t *testing.T) {
	rng := rand.New(rand.NewPCG(43, 0))
	for _, stop := range []bool{false, true} {
		h := newHarness(t, 64, Config{Self: "w1"}, nil)
		r := h.submit("x", prompt(rng, 100), nil, 40)
		r.Holder, r.Reserved = "w9", 1<<30
		h.step()
		h.step()
		if len(h.ckpt["x"]) == 0 {
			t.Fatal("nothing checkpointed")
		}
		if err := h.c.MigrateOut("x", 0); err != nil {
			t.Fatal(err)
		}
		if stop {
			if st, err := h.c.NextStage("x", 0); err != nil || !st.Last {
				t.Fatalf("7 pages with a stop at 16: last %v, %v", st.Last, err)
			}
		}
		h.c.Cancel(r)
		o := h.c.Output()
		if got := len(o.CheckpointReleases) == 1; got == stop {
			t.Errorf("stopped %v: checkpoint released %v", stop, got)
		}
	}
}

// TestAdoptionKeepsTheCheckpointProgress: a migrated request that keeps
// its holder is not checkpointed again from its first page at the
// destination: only the pages its source had not sent go; with a new
// holder every page goes.
func TestAdoptionKeepsTheCheckpointProgress(t *testing.T) {
	rng := rand.New(rand.NewPCG(47, 0))
	p := prompt(rng, 100)
	for _, holder := range []string{"w9", "w8"} {
		src := newHarness(t, 64, Config{Self: "w1"}, nil)
		dst := newHarness(t, 64, Config{Self: "w2"}, nil)
		r := src.submit("x", p, nil, 40)
		r.Holder, r.Reserved = "w9", 1<<30
		for range 3 {
			src.step()
		}
		sent := len(src.ckpt["x"])
		stages, err := migration(t, src, dst, "x", 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if last := stages[len(stages)-1]; last.Holder != "w9" || last.Checkpointed != sent {
			t.Fatalf("the last stage says holder %q with %d pages, want w9 with %d", last.Holder, last.Checkpointed, sent)
		}
		src.c.CommitOut("x", 0)
		src.apply()
		call := &Request{ID: "x", Epoch: 1, History: append(slices.Clone(p), src.out["x"]...), Prompt: len(p), MaxTokens: 40,
			Holder: holder, Reserved: 1 << 30, Arrived: dst.now}
		dst.c.Submit(call)
		dst.apply()
		dst.step()
		want := PageHashes(call.History[:call.Fed()], nil)
		if holder == "w9" {
			want = want[sent:]
		}
		if !slices.Equal(dst.ckpt["x"], want) {
			t.Errorf("holder %s: the destination queued %d pages for it, want %d", holder, len(dst.ckpt["x"]), len(want))
		}
	}
}

// TestStoppedRequestKeepsItsSlot: a request stopped for its migration's
// commit keeps its running slot, so an abort that puts it back in the
// running set never takes the worker over MaxRunning (the simulator's
// budget check caught a source that admitted a waiting request into the
// stopped one's slot, then ran 33 of 32 after the destination refused the
// last stage).
func TestStoppedRequestKeepsItsSlot(t *testing.T) {
	seed := uint64(43)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	src := newHarness(t, 128, Config{Self: "w1", MaxRunning: 2}, nil)
	for _, id := range []string{"a", "b", "c"} {
		src.submit(id, prompt(rng, 40), nil, 20)
	}
	src.step()
	if src.c.Running() != 2 || src.c.Waiting() != 1 {
		t.Fatalf("%d running, %d waiting; want 2 and 1", src.c.Running(), src.c.Waiting())
	}
	if err := src.c.MigrateOut("a", 0); err != nil {
		t.Fatal(err)
	}
	st, err := src.c.NextStage("a", 0)
	src.apply()
	if err != nil || !st.Last {
		t.Fatalf("a 3-page request's first stage is not the last: %+v, %v", st, err)
	}
	src.step()
	if src.c.Running() != 1 || src.c.Waiting() != 1 {
		t.Fatalf("with a stopped: %d running, %d waiting; want 1 and 1 (c waits for a's slot)", src.c.Running(), src.c.Waiting())
	}
	dst := newHarness(t, 128, Config{Self: "w2", MaxRunning: 2}, nil)
	dst.submit("d", prompt(rng, 40), nil, 20)
	dst.step()
	if _, err := dst.c.AcceptStage(dst.now, IncomingStage{ID: "x", Stage: 1}, dst.eng.FreePages()); err != nil {
		t.Fatal(err)
	}
	if _, err := dst.c.AcceptStage(dst.now, IncomingStage{ID: "y", Stage: 1}, dst.eng.FreePages()); !errors.Is(err, ErrMigrationFull) {
		t.Fatalf("a second migration into a worker with one running and one migrating in of 2: %v, want ErrMigrationFull", err)
	}
	// A re-dispatch (a request queued at its source: one last stage of no
	// pages) holds no running slot: the full worker takes it, and its
	// call queues.
	if _, err := dst.c.AcceptStage(dst.now, IncomingStage{ID: "z", Stage: 1, Last: true, History: prompt(rng, 40)}, dst.eng.FreePages()); err != nil {
		t.Fatalf("a re-dispatch into a worker with no free slot: %v", err)
	}
	if n := dst.c.slots(); n != 2 {
		t.Fatalf("%d slots taken with one running, one migrating in and a re-dispatch; want 2", n)
	}
	if !src.c.AbortOut("a", 0) {
		t.Fatal("no migration to abort")
	}
	if src.c.Running() != 2 {
		t.Fatalf("%d running after the abort, MaxRunning is 2", src.c.Running())
	}
	src.run()
	for _, id := range []string{"a", "b", "c"} {
		if len(src.out[id]) != 20 || src.errs[id] != nil {
			t.Fatalf("%s: %d tokens, %v", id, len(src.out[id]), src.errs[id])
		}
	}
	src.checkAllFree(t, "source")
}

// TestHeldPreStep: after the last stage the destination decodes the
// request before its call arrives (the held pre-step) — at most
// MigrationHoldTokens tokens, and never past its end — and the call's
// adoption delivers them, with the source's tokens the gateway lacks, at
// once. The outputs are the reference's, nothing is recomputed, and an
// abort frees the held pages.
func TestHeldPreStep(t *testing.T) {
	seed := uint64(71)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	cases := []struct {
		name string
		// The source decodes done tokens of max; the destination then
		// steps steps times before the call, which lacks cut of the
		// source's tokens; hold is Config.MigrationHoldTokens.
		done, max, steps, cut, hold int
		held                        int // tokens the pre-step holds
		abort                       bool
	}{
		{name: "one step", done: 10, max: 40, steps: 1, held: 1},
		{name: "lacking the source's last tokens", done: 10, max: 40, steps: 2, cut: 2, held: 2},
		{name: "the call comes late: capped", done: 10, max: 40, steps: 9, cut: 1, hold: 3, held: 3},
		{name: "decoded to its end", done: 37, max: 40, steps: 6, held: 3},
		{name: "no call before the step", done: 10, max: 40, steps: 0, held: 0},
		{name: "aborted", done: 10, max: 40, steps: 2, held: 2, abort: true},
		{name: "pre-step off", done: 10, max: 40, steps: 2, hold: -1, held: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			src := newHarness(t, 64, Config{Self: "w1", TokenBudget: 64, MaxRunning: 4}, nil)
			dst := newHarness(t, 64, Config{Self: "w2", TokenBudget: 64, MaxRunning: 4, MigrationHoldTokens: tc.hold}, nil)
			p := prompt(rng, 20+rng.IntN(60))
			want := reference(t, p, tc.max)
			src.submit("r", p, nil, tc.max)
			for len(src.out["r"]) < tc.done {
				src.step()
			}
			if _, err := migration(t, src, dst, "r", 0, 0); err != nil {
				t.Fatal(err)
			}
			for range tc.steps {
				dst.step()
			}
			if got := dst.total.HeldTokens; got != tc.held {
				t.Fatalf("the pre-step held %d tokens, want %d", got, tc.held)
			}
			if tc.abort {
				if !dst.c.AbortIn("r", 0) {
					t.Fatal("no pre-allocation to abort")
				}
				dst.apply()
				if !dst.c.Idle() {
					t.Fatal("the aborted pre-step still runs")
				}
				dst.checkAllFree(t, "destination")
				return
			}
			src.c.CommitOut("r", 0)
			src.apply()
			streamed := src.out["r"][:len(src.out["r"])-tc.cut]
			resume(dst, "r", p, streamed, tc.max, 1)
			if n := len(dst.out["r"]); n != tc.cut+tc.held {
				t.Fatalf("the call got %d tokens at once, want the %d it lacked and the %d held", n, tc.cut, tc.held)
			}
			dst.run()
			if out := append(slices.Clone(streamed), dst.out["r"]...); !slices.Equal(out, want) {
				t.Fatalf("output %v, want %v", out, want)
			}
			if err := dst.errs["r"]; err != nil {
				t.Fatalf("the request ended with %v", err)
			}
			if dst.total.RecomputedTokens != 0 {
				t.Fatalf("%d tokens recomputed", dst.total.RecomputedTokens)
			}
			dst.checkAllFree(t, "destination")
		})
	}
}
