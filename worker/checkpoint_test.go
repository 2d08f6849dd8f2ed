package worker

import "testing"

func TestCkptStoreBudgetAndPrefix(t *testing.T) {
	s := newCkptStore(100)
	page := make([]byte, 40)
	if !s.put("a", 0, 1, page) || !s.put("a", 0, 2, page) {
		t.Fatal("pages within budget refused")
	}
	if s.put("b", 0, 3, page) {
		t.Fatal("a page past the budget was stored")
	}
	if used, _ := s.usage(); used != 80 {
		t.Fatalf("used %d", used)
	}
	if got := s.prefix([]uint64{1, 2, 3}); len(got) != 2 {
		t.Fatalf("prefix of %d pages", len(got))
	}
	if got := s.prefix([]uint64{9, 1}); len(got) != 0 {
		t.Fatal("a prefix must start at page 0")
	}
	// Shared prefix pages are kept until every request releases them.
	if !s.put("b", 0, 1, page) {
		t.Fatal("sharing a stored page refused")
	}
	s.release("a")
	if got := s.prefix([]uint64{1}); len(got) != 1 {
		t.Fatal("a page still used by b was dropped")
	}
	s.release("b")
	if used, _ := s.usage(); used != 0 {
		t.Fatalf("used %d after every release", used)
	}
	// A request's reservation bounds its pages.
	if !s.put("c", 50, 7, page) || s.put("c", 50, 8, page) {
		t.Fatal("reservation not enforced")
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
