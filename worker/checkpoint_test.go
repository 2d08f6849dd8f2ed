package worker

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// stored reports whether the store took the page.
func stored(t *testing.T, s *ckptStore, req string, reserved, hash uint64, data []byte) bool {
	t.Helper()
	_, err := s.put(req, reserved, hash, data)
	return err == nil
}

func TestCkptStoreBudgetAndPrefix(t *testing.T) {
	s := newCkptStore(100)
	page := make([]byte, 40)
	if !stored(t, s, "a", 1000, 1, page) || !stored(t, s, "a", 1000, 2, page) {
		t.Fatal("pages within budget refused")
	}
	if _, err := s.put("b", 1000, 3, page); !errors.Is(err, errStoreFull) {
		t.Fatalf("a page past the budget: %v", err)
	}
	if used, _, _ := s.usage(); used != 80 {
		t.Fatalf("used %d", used)
	}
	if got := s.prefix([]uint64{1, 2, 3}); len(got) != 2 {
		t.Fatalf("prefix of %d pages", len(got))
	}
	if got := s.prefix([]uint64{9, 1}); len(got) != 0 {
		t.Fatal("a prefix must start at page 0")
	}
	// Shared prefix pages are kept until every request releases them.
	if !stored(t, s, "b", 1000, 1, page) {
		t.Fatal("sharing a stored page refused")
	}
	s.release("a")
	if got := s.prefix([]uint64{1}); len(got) != 1 {
		t.Fatal("a page still used by b was dropped")
	}
	s.release("b")
	if used, _, n := s.usage(); used != 0 || n != 0 {
		t.Fatalf("used %d by %d requests after every release", used, n)
	}
}

// TestCkptStoreEnforcesReservation: the reservation a page carries caps its
// request, and a page without one is refused: the field is not sent to be
// ignored (the sender left it 0 and the cap never applied).
func TestCkptStoreEnforcesReservation(t *testing.T) {
	s := newCkptStore(1 << 20)
	page := make([]byte, 40)
	if !stored(t, s, "c", 80, 7, page) || !stored(t, s, "c", 80, 8, page) {
		t.Fatal("pages within the reservation refused")
	}
	first, err := s.put("c", 80, 9, page)
	if !errors.Is(err, errOverReservation) || !first {
		t.Fatalf("a page past the reservation: first=%v %v", first, err)
	}
	if first, err := s.put("c", 80, 10, page); err == nil || first {
		t.Fatalf("a second refusal: first=%v %v (want refused, not first)", first, err)
	}
	if charged, reserved, _ := s.stored("c"); charged != 80 || reserved != 80 {
		t.Fatalf("c has %d bytes charged of %d reserved", charged, reserved)
	}
	if _, err := s.put("d", 0, 11, page); !errors.Is(err, errNoReservation) {
		t.Fatalf("a page without a reservation: %v", err)
	}
	// A page another request stored costs nothing more.
	if !stored(t, s, "e", 40, 7, page) || !stored(t, s, "e", 40, 12, page) {
		t.Fatal("a shared page was charged to the request that shares it")
	}
}

// TestCkptStoreReleaseUnchanged: the reconciler's release skips a request
// whose pages changed after it looked.
func TestCkptStoreReleaseUnchanged(t *testing.T) {
	s := newCkptStore(1 << 20)
	page := make([]byte, 40)
	stored(t, s, "a", 1000, 1, page)
	held := s.requests()
	if len(held) != 1 || held[0].req != "a" {
		t.Fatalf("requests %v", held)
	}
	stored(t, s, "a", 1000, 2, page)
	if s.releaseUnchanged("a", held[0].gen) {
		t.Fatal("released pages that arrived after the look")
	}
	if !s.releaseUnchanged("a", s.requests()[0].gen) {
		t.Fatal("unchanged pages not released")
	}
	if used, _, n := s.usage(); used != 0 || n != 0 {
		t.Fatalf("used %d by %d requests", used, n)
	}
}

func TestPageHashesChain(t *testing.T) {
	a := make([]int32, 40)
	b := make([]int32, 40)
	b[20] = 1 // differs in page 1
	ha, hb := pageHashes(a, nil), pageHashes(b, nil)
	if len(ha) != 2 || ha[0] != hb[0] || ha[1] == hb[1] {
		t.Fatalf("hashes %v %v", ha, hb)
	}
	if inc := pageHashes(a, pageHashes(a[:16], nil)); inc[1] != ha[1] {
		t.Fatal("incremental hashing differs")
	}
}

// TestCheckpointPrefixesAnswers: CheckpointPrefixes reports, per request,
// the tokens of the pages the store holds of it (0 for one it holds
// nothing of), and refuses a call past its limit by name.
func TestCheckpointPrefixesAnswers(t *testing.T) {
	w := &Worker{store: newCkptStore(1 << 20)}
	page := make([]byte, 40)
	for h := uint64(1); h <= 3; h++ {
		if !stored(t, w.store, "a", 1000, h, page) {
			t.Fatal("a page within budget refused")
		}
	}
	if !stored(t, w.store, "b", 1000, 9, page) {
		t.Fatal("a page within budget refused")
	}
	s := &inferenceServer{w: w}
	resp, err := s.CheckpointPrefixes(context.Background(), &pb.CheckpointPrefixesRequest{RequestIds: []string{"a", "none", "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint32{3 * engine.PageTokens, 0, engine.PageTokens}; !slices.Equal(resp.Tokens, want) {
		t.Fatalf("tokens %v, want %v", resp.Tokens, want)
	}
	_, err = s.CheckpointPrefixes(context.Background(), &pb.CheckpointPrefixesRequest{RequestIds: make([]string, maxPrefixQueries+1)})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "at most 65536") {
		t.Fatalf("a call past the limit: %v", err)
	}
}
