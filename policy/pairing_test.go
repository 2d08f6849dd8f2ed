package policy

import (
	"fmt"
	"math"
	"math/rand"
	"reflect"
	"testing"
	"time"
)

func TestPairDrafters(t *testing.T) {
	ineligible := func(id string, q float64) Worker { x := w(id, q); x.Eligible = false; return x }
	cases := []struct {
		name     string
		drafters []string
		ws       []Worker
		paired   map[string]bool
		want     []Pair
	}{
		{"no drafters", nil, []Worker{w("a", 1)}, nil, nil},
		{"no candidates", []string{"d"}, []Worker{ineligible("a", 9)}, nil, []Pair{}},
		{"highest q_w", []string{"d"}, []Worker{w("a", 1), w("b", 7), w("c", 3)}, nil,
			[]Pair{{"d", "b", 7}}},
		{"one to one, in drafter order", []string{"d1", "d2"}, []Worker{w("a", 1), w("b", 7), w("c", 3)}, nil,
			[]Pair{{"d1", "b", 7}, {"d2", "c", 3}}},
		{"ties to the smaller id", []string{"d1", "d2"}, []Worker{w("a", 2), w("b", 5), w("c", 5)}, nil,
			[]Pair{{"d1", "b", 5}, {"d2", "c", 5}}},
		{"already paired skipped", []string{"d"}, []Worker{w("a", 1), w("b", 7), w("c", 3)}, map[string]bool{"b": true},
			[]Pair{{"d", "c", 3}}},
		{"ineligible skipped", []string{"d"}, []Worker{w("a", 1), ineligible("b", 70)}, nil,
			[]Pair{{"d", "a", 1}}},
		{"more drafters than targets", []string{"d1", "d2", "d3"}, []Worker{w("a", 1), w("b", 2)}, nil,
			[]Pair{{"d1", "b", 2}, {"d2", "a", 1}}},
		{"NaN q_w last", []string{"d1", "d2"}, []Worker{w("a", math.NaN()), w("b", 0)}, nil,
			[]Pair{{"d1", "b", 0}, {"d2", "a", math.NaN()}}},
	}
	for _, c := range cases {
		got := PairDrafters(c.drafters, c.ws, c.paired)
		if len(got) != len(c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
			continue
		}
		for k := range got {
			g, x := got[k], c.want[k]
			if g.Drafter != x.Drafter || g.Target != x.Target ||
				!(g.TargetQueueWaitMs == x.TargetQueueWaitMs || math.IsNaN(g.TargetQueueWaitMs) && math.IsNaN(x.TargetQueueWaitMs)) {
				t.Errorf("%s: %v, want %v", c.name, got, c.want)
				break
			}
		}
	}
}

// TestPairDraftersProperties checks random inputs against the definition:
// one to one, only eligible unpaired targets, each drafter the best left,
// as many pairs as possible, the same answer for a shuffled paired map.
func TestPairDraftersProperties(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	for iter := 0; iter < 500; iter++ {
		var ws []Worker
		paired := map[string]bool{}
		for i := 0; i < rng.Intn(12); i++ {
			x := w(fmt.Sprintf("w%02d", i), float64(rng.Intn(5)))
			x.Eligible = rng.Intn(4) != 0
			if rng.Intn(4) == 0 {
				paired[x.ID] = true
			}
			ws = append(ws, x)
		}
		var drafters []string
		for i := 0; i < rng.Intn(6); i++ {
			drafters = append(drafters, fmt.Sprintf("d%02d", i))
		}
		got := PairDrafters(drafters, ws, paired)
		again := PairDrafters(drafters, ws, clonePaired(paired))
		if !reflect.DeepEqual(got, again) {
			t.Fatalf("seed %d: %v then %v", seed, got, again)
		}
		free := 0
		for _, x := range ws {
			if x.Eligible && !paired[x.ID] {
				free++
			}
		}
		if len(got) != min(free, len(drafters)) {
			t.Fatalf("seed %d: %d pairs for %d drafters and %d free targets", seed, len(got), len(drafters), free)
		}
		taken := map[string]bool{}
		for k, p := range got {
			if p.Drafter != drafters[k] {
				t.Fatalf("seed %d: pair %d is for %s, want %s", seed, k, p.Drafter, drafters[k])
			}
			if taken[p.Target] || paired[p.Target] {
				t.Fatalf("seed %d: %s taken twice", seed, p.Target)
			}
			taken[p.Target] = true
			var tw Worker
			for _, x := range ws {
				if x.ID == p.Target {
					tw = x
				}
			}
			if !tw.Eligible || tw.QueueWaitMs != p.TargetQueueWaitMs {
				t.Fatalf("seed %d: target %+v for pair %+v", seed, tw, p)
			}
			for _, x := range ws {
				if !x.Eligible || paired[x.ID] || taken[x.ID] {
					continue
				}
				if x.QueueWaitMs > tw.QueueWaitMs || x.QueueWaitMs == tw.QueueWaitMs && x.ID < tw.ID {
					t.Fatalf("seed %d: %s got %s while %s (q_w %v) was free", seed, p.Drafter, tw.ID, x.ID, x.QueueWaitMs)
				}
			}
		}
	}
}

func clonePaired(m map[string]bool) map[string]bool {
	out := make(map[string]bool, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
