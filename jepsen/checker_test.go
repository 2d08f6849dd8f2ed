package jepsen

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The checkers must catch what they are for: each hand-built history below
// breaks one promise.

func TestLinearizableAcceptsAValidHistory(t *testing.T) {
	ops := []Op{
		{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 10, Found: true, Worker: "w1", Created: 5},
		{Client: 1, Kind: GetLin, ID: "a", Call: 5, Return: 8, Found: false}, // concurrent with the dispatch
		{Client: 1, Kind: GetLin, ID: "a", Call: 11, Return: 12, Found: true, Worker: "w1", Created: 5},
		// A move by recovery: a higher epoch, another worker.
		{Client: 0, Kind: GetLin, ID: "a", Call: 13, Return: 14, Found: true, Worker: "w2", Epoch: 1, Created: 5},
		{Client: 0, Kind: Complete, ID: "a", Call: 15, Return: 16, Found: true},
		{Client: 1, Kind: GetLin, ID: "a", Call: 17, Return: 18, Found: false},
		// An indeterminate dispatch may or may not have happened.
		{Client: 2, Kind: Dispatch, ID: "b", Call: 0, Return: Unknown, Indeterminate: true},
		{Client: 1, Kind: GetLin, ID: "b", Call: 20, Return: 21, Found: false},
		{Client: 1, Kind: GetLin, ID: "b", Call: 22, Return: 23, Found: true, Worker: "w3", Created: 9},
	}
	if v := CheckLinearizable(ops, "", time.Minute); !v.OK {
		t.Fatalf("valid history rejected: %v", v.Violations)
	}
}

func TestLinearizableCatchesAStaleRead(t *testing.T) {
	dir := t.TempDir()
	html := filepath.Join(dir, "lin.html")
	for name, ops := range map[string][]Op{
		"read misses an acknowledged dispatch": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 10, Found: true, Worker: "w1", Created: 5},
			{Client: 1, Kind: GetLin, ID: "a", Call: 11, Return: 12, Found: false},
		},
		"read sees an older epoch": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
			{Client: 0, Kind: GetLin, ID: "a", Call: 2, Return: 3, Found: true, Worker: "w2", Epoch: 1, Created: 5},
			{Client: 1, Kind: GetLin, ID: "a", Call: 4, Return: 5, Found: true, Worker: "w1", Epoch: 0, Created: 5},
		},
		"completed placement comes back": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
			{Client: 0, Kind: Complete, ID: "a", Call: 2, Return: 3, Found: true},
			{Client: 1, Kind: GetLin, ID: "a", Call: 4, Return: 5, Found: true, Worker: "w1", Created: 5},
		},
		"a different placement under the same id": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
			{Client: 1, Kind: GetLin, ID: "a", Call: 2, Return: 3, Found: true, Worker: "w1", Created: 7},
		},
	} {
		v := CheckLinearizable(ops, html, time.Minute)
		if v.OK {
			t.Errorf("%s: not caught", name)
		}
	}
	if _, err := os.Stat(html); err != nil {
		t.Fatalf("no visualization written: %v", err)
	}
}

// A refused Dispatch (no worker in full service, an id already completed)
// changed nothing: reads after it see no placement, and a refusal of an id
// that has a placement, or that names the wrong reason, is caught.
func TestLinearizableRefusedDispatch(t *testing.T) {
	noWorker := "rpc error: code = FailedPrecondition desc = fsm: no worker in full service"
	completedErr := "rpc error: code = FailedPrecondition desc = fsm: request already completed: \"a\""
	ok := []Op{
		{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 10, Err: noWorker},
		{Client: 1, Kind: GetLin, ID: "a", Call: 11, Return: 12, Found: false},
		{Client: 0, Kind: Dispatch, ID: "b", Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
		{Client: 0, Kind: Complete, ID: "b", Call: 2, Return: 3, Found: true},
		{Client: 1, Kind: Dispatch, ID: "b", Call: 4, Return: 5, Err: completedErr},
		{Client: 1, Kind: GetLin, ID: "b", Call: 6, Return: 7, Found: false},
	}
	if v := CheckLinearizable(ok, "", time.Minute); !v.OK {
		t.Fatalf("valid refusals rejected: %v", v.Violations)
	}
	for name, ops := range map[string][]Op{
		"a read finds a placement the refused dispatch never made": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 10, Err: noWorker},
			{Client: 1, Kind: GetLin, ID: "a", Call: 11, Return: 12, Found: true, Worker: "w1", Created: 5},
		},
		"a present id refused": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
			{Client: 1, Kind: Dispatch, ID: "a", Call: 2, Return: 3, Err: noWorker},
		},
		"a never-completed id refused as completed": {
			{Client: 0, Kind: Dispatch, ID: "a", Call: 0, Return: 1, Err: completedErr},
		},
	} {
		v := CheckLinearizable(ops, "", time.Minute)
		if v.OK {
			t.Errorf("%s: not caught", name)
		} else if len(v.Violations) < 2 || !strings.Contains(v.Violations[1], "request a:") {
			t.Errorf("%s: the violation does not name the request: %v", name, v.Violations)
		}
	}
}

func TestDurableCatchesALostWrite(t *testing.T) {
	ops := []Op{
		{Kind: Dispatch, ID: "a", Found: true, Worker: "w1", Created: 5, Index: 5},
		{Kind: Dispatch, ID: "b", Found: true, Worker: "w2", Created: 6, Index: 6},
		{Kind: Complete, ID: "b", Found: true},
		{Kind: Dispatch, ID: "c", Indeterminate: true, Return: Unknown},
	}
	ok := map[string]Op{"a": {ID: "a", Found: true, Worker: "w1", Created: 5}, "b": {ID: "b"}}
	if v := CheckDurable(ops, ok); !v.OK {
		t.Fatalf("durable history rejected: %v", v.Violations)
	}
	lost := map[string]Op{"a": {ID: "a"}, "b": {ID: "b"}}
	if v := CheckDurable(ops, lost); v.OK || !strings.Contains(v.Violations[0], "lost") {
		t.Fatalf("lost write not caught: %+v", v)
	}
	back := map[string]Op{"a": ok["a"], "b": {ID: "b", Found: true, Worker: "w2"}}
	if v := CheckDurable(ops, back); v.OK {
		t.Fatal("completed placement back from the dead not caught")
	}
}

func TestStaleReadsMustBeCommittedStates(t *testing.T) {
	ops := []Op{
		{Kind: Dispatch, ID: "a", Found: true, Created: 5},
		{Kind: GetStale, ID: "a", Found: false}, // before the dispatch applied here: fine
		{Kind: GetStale, ID: "a", Found: true, Created: 5},
	}
	if v := CheckStaleReads(ops); !v.OK {
		t.Fatalf("valid stale reads rejected: %v", v.Violations)
	}
	bad := append(ops, Op{Kind: GetStale, ID: "zz", Found: true, Worker: "w1"}, Op{Kind: GetStale, ID: "a", Found: true, Created: 9})
	if v := CheckStaleReads(bad); v.OK || len(v.Violations) != 2 {
		t.Fatalf("phantom and foreign stale reads: %+v", v)
	}
}

func TestServingCatchesACorruptedOutput(t *testing.T) {
	ref := func(prompt string, max int) string { return strings.Repeat("x", max) }
	good := []Stream{
		{Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxx"},
		{Prompt: "p", Max: 3, Accepted: true, ErrEvent: "no worker"},
		{Prompt: "p", Max: 3, Err: "HTTP 429"},
	}
	if v := CheckServing(good, nil, ref); !v.OK {
		t.Fatalf("good streams rejected: %v", v.Violations)
	}
	for name, s := range map[string]Stream{
		"a repeated token": {Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxxx"},
		"a gap":            {Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xx"},
		"a changed token":  {Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xyx"},
		"a silent cut":     {Prompt: "p", Max: 3, Accepted: true, Text: "x", Err: "stream cut"},
	} {
		if v := CheckServing([]Stream{s}, nil, ref); v.OK {
			t.Errorf("%s: not caught", name)
		}
	}
}

func TestInvariantCheckers(t *testing.T) {
	if v := CheckBudgets([]BudgetSample{{Worker: "w1", Reserved: 10, Stored: 10, Budget: 10}}, 0); !v.OK {
		t.Fatal("a full budget is not over it")
	}
	if v := CheckBudgets([]BudgetSample{{Worker: "w1", Reserved: 11, Budget: 10}}, 0); v.OK {
		t.Fatal("reservations over budget not caught")
	}
	if v := CheckBudgets([]BudgetSample{{Worker: "w1", Reserved: 1, Stored: 11, Budget: 10}}, 100); v.OK {
		t.Fatal("a store over budget not caught")
	}
	fails := []Failure{{Worker: "w1", Inc: 1, Index: 100}}
	ops := []Op{
		{Kind: Dispatch, ID: "a", Worker: "w1", Inc: 1, Index: 99},
		{Kind: Dispatch, ID: "b", Worker: "w1", Inc: 2, Index: 150}, // the new incarnation
	}
	if v := CheckNoDispatchToFailed(ops, fails); !v.OK {
		t.Fatalf("valid dispatches rejected: %v", v.Violations)
	}
	ops = append(ops, Op{Kind: Dispatch, ID: "c", Worker: "w1", Inc: 1, Index: 101})
	if v := CheckNoDispatchToFailed(ops, fails); v.OK {
		t.Fatal("dispatch to a failed incarnation not caught")
	}
	if v := CheckConverged([]ReplicaState{{"c1", 9, 1}, {"c2", 9, 1}}); !v.OK {
		t.Fatal("equal replicas rejected")
	}
	if v := CheckConverged([]ReplicaState{{"c1", 9, 1}, {"c2", 9, 2}}); v.OK {
		t.Fatal("diverged replicas not caught")
	}
}

// node-kill: every incarnation a node kill took must be marked FAILED; a
// failure of another incarnation of the same worker does not count.
func TestCheckNodeKills(t *testing.T) {
	kills := []NodeKill{{Node: "node-1", At: 100, Workers: []string{"worker-1", "worker-2"}, Incs: []uint64{3, 1}}}
	fails := []Failure{{Worker: "worker-1", Inc: 3, Index: 10}, {Worker: "worker-2", Inc: 1, Index: 11}}
	if v := CheckNodeKills(kills, fails); !v.OK {
		t.Fatalf("both killed incarnations failed, yet: %v", v.Violations)
	}
	if v := CheckNodeKills(kills, fails[:1]); v.OK || len(v.Violations) != 1 {
		t.Fatalf("worker-2 never marked failed not caught: %+v", v)
	}
	if v := CheckNodeKills(kills, []Failure{{Worker: "worker-1", Inc: 2}, {Worker: "worker-2", Inc: 1}}); v.OK {
		t.Fatal("an older incarnation's failure taken for the killed one's")
	}
}

// nodeKillNodes puts two workers a node; 3 workers make two nodes.
func TestNodeKillNodes(t *testing.T) {
	for workers, want := range map[int]int{2: 1, 3: 2, 4: 2, 5: 3} {
		if got := nodeKillNodes(workers); got != want {
			t.Errorf("%d workers: %d nodes, want %d", workers, got, want)
		}
	}
}

// A gateway's crash is visible to its clients: streams cut while their own
// gateway was killed are aborted, not violations; a cut anywhere else is
// one, and so is a kill during which no other gateway completed a stream.
func TestCheckerServingGatewayKill(t *testing.T) {
	ref := func(prompt string, max int) string { return strings.Repeat("x", max) }
	kills := []GatewayKill{{Gateway: "gateway", At: 100, Dead: 110, Restarted: 200}}
	survivor := Stream{Client: 1, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxx", Call: 90, Return: 150}
	good := []Stream{
		// Cut by the kill: open before the process died, ended after the
		// SIGKILL was sent.
		{Client: 0, N: 0, Gateway: "gateway", Prompt: "p", Max: 3, Accepted: true, Text: "x", Err: "stream cut: unexpected EOF", Call: 50, Return: 105},
		// Began while the SIGKILL was on its way.
		{Client: 0, N: 1, Gateway: "gateway", Prompt: "p", Max: 3, Accepted: true, Err: "stream cut: unexpected EOF", Call: 108, Return: 112},
		// Refused while it was down.
		{Client: 0, N: 2, Gateway: "gateway", Prompt: "p", Max: 3, Err: "connection refused", Call: 120, Return: 121},
		survivor,
	}
	v := CheckServing(good, kills, ref)
	if !v.OK {
		t.Fatalf("streams aborted by their gateway's crash counted as violations: %v", v.Violations)
	}
	if !strings.Contains(v.Note, "2 streams aborted") {
		t.Fatalf("aborted streams not counted: %s", v.Note)
	}
	// A stream on the other gateway longer than the window (migrate's 320
	// tokens) is served through it: it got tokens while the gateway was
	// down, and completed equal to the reference.
	long := Stream{Client: 1, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxx", Call: 10, Return: 250, TokenTimes: []int64{20, 150, 240}}
	if v := CheckServing([]Stream{long}, kills, ref); !v.OK {
		t.Fatalf("a stream served across the window rejected: %v", v.Violations)
	}
	for name, streams := range map[string][]Stream{
		"a cut on the surviving gateway": {survivor,
			{Client: 1, N: 1, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Err: "stream cut", Call: 95, Return: 130}},
		"a cut on the killed gateway, outside the kill": {survivor,
			{Client: 0, N: 3, Gateway: "gateway", Prompt: "p", Max: 3, Accepted: true, Err: "stream cut", Call: 300, Return: 310}},
		"a corrupted output on the surviving gateway": {survivor,
			{Client: 1, N: 2, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xyx", Call: 95, Return: 130}},
		"a changed token before the crash": {survivor,
			{Client: 0, N: 4, Gateway: "gateway", Prompt: "p", Max: 3, Accepted: true, Text: "xy", Err: "stream cut", Call: 50, Return: 105}},
		"nothing served while the gateway was down": {
			{Client: 1, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxx", Call: 10, Return: 20}},
		"a stream across the window that got no token in it": {
			{Client: 1, Gateway: "gateway-2", Prompt: "p", Max: 3, Accepted: true, Done: true, Text: "xxx", Call: 10, Return: 250, TokenTimes: []int64{20, 30, 240}}},
	} {
		if v := CheckServing(streams, kills, ref); v.OK {
			t.Errorf("%s: not caught", name)
		}
	}
}

// During the run a holder stores at most what the placement table reserves
// on it plus the in-flight slack; pages beyond are pages of requests it no
// longer holds.
func TestCheckerStoredVsReserved(t *testing.T) {
	ok := []BudgetSample{
		{Worker: "w1", Reserved: 5 << 20, Held: 1, Stored: 4096, Budget: 1 << 30},
		{Worker: "w2", Reserved: 0, Stored: 1000, Budget: 1 << 30}, // a release on its way
	}
	if v := CheckBudgets(ok, 1000); !v.OK {
		t.Fatalf("valid samples rejected: %v", v.Violations)
	}
	leak := []BudgetSample{{Worker: "w2", Reserved: 0, Stored: 1001, Budget: 1 << 30}}
	if v := CheckBudgets(leak, 1000); v.OK || !strings.Contains(v.Violations[0], "w2") {
		t.Fatalf("a holder storing pages nobody reserves not caught: %+v", v)
	}
}

// After quiescence nothing is left: no placement, no reservation, no
// stored page.
func TestCheckerNoLeak(t *testing.T) {
	quiet := Quiescence{Holders: []BudgetSample{{Worker: "w1", Budget: 10}, {Worker: "w2", Budget: 10}},
		Workers: []WorkerQuiet{{Worker: "w1", Reported: true}, {Worker: "w2", Reported: true}}}
	if v := CheckNoLeak(quiet); !v.OK || !quiet.Quiet() {
		t.Fatalf("a quiet cluster rejected: %v", v.Violations)
	}
	for name, q := range map[string]Quiescence{
		"a placement survives":      {Placements: 1, Holders: quiet.Holders},
		"a reservation survives":    {Holders: []BudgetSample{{Worker: "w1", Reserved: 5, Held: 1}}},
		"a holder keeps pages":      {Holders: []BudgetSample{{Worker: "w1", Stored: 4096}}},
		"the cluster is gone":       {Err: "no controller answered"},
		"no workers":                {},
		"a worker keeps pages":      {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, KVPages: 3}}},
		"a request still runs":      {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, Running: 1}}},
		"a pre-allocation stays":    {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, LiveIn: 1}}},
		"a migration out stays":     {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, LiveOut: 1}}},
		"a placement migrates":      {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, TableIn: 1}}},
		"a worker never reports":    {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1"}}},
		"a worker's metrics unread": {Holders: quiet.Holders, Workers: []WorkerQuiet{{Worker: "w1", Reported: true, ScrapeErr: "connection refused"}}},
	} {
		if v := CheckNoLeak(q); v.OK || q.Quiet() {
			t.Errorf("%s: not caught", name)
		}
	}
}

// The panic scan finds a runtime panic, a fatal error and a recovered
// panic's logged stack, and names the process; clean logs pass.
func TestCheckerPanicScan(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("ctl1.log", "2026-12-01T10:00:00.000Z [INFO]  controller: leader elected: id=ctl1\n"+
		"2026-12-01T10:00:01.000Z [WARN]  controller: a worker said: don't panic: fine\n")
	write("worker-1.log", "2026-12-01T10:00:00.000Z [INFO]  worker: registered\n")
	if err := os.MkdirAll(filepath.Join(dir, "ctl1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if v := CheckPanics(dir); !v.OK {
		t.Fatalf("clean logs rejected: %v", v.Violations)
	}

	write("ctl2.log", "2026-12-01T10:00:00.000Z [INFO]  controller: follower\n"+
		"panic: runtime error: invalid memory address or nil pointer dereference\n"+
		"[signal SIGSEGV: segmentation violation code=0x1 addr=0x10 pc=0x1234]\n\n"+
		"goroutine 42 [running]:\n"+
		"github.com/lumen-project/lumen/controller.(*server).Dispatch(...)\n")
	write("worker-2.log", "fatal error: concurrent map writes\n\ngoroutine 7 [running]:\n")
	write("gateway-2.log", "2026-12-01T10:00:00.000Z [ERROR] controller: handler panicked: method=/lumen.Controller/Complete\n"+
		"  stack=\n"+
		"  | goroutine 99 [running]:\n"+
		"  | runtime/debug.Stack()\n")
	v := CheckPanics(dir)
	if v.OK || len(v.Violations) != 3 {
		t.Fatalf("want 3 panicked processes, got %+v", v)
	}
	all := strings.Join(v.Violations, "\n")
	for _, want := range []string{"ctl2 panicked", "line 2", "invalid memory address", "worker-2 panicked", "concurrent map writes", "gateway-2 panicked", "goroutine 99"} {
		if !strings.Contains(all, want) {
			t.Errorf("the verdict does not say %q:\n%s", want, all)
		}
	}
	if strings.Contains(all, "ctl1") || strings.Contains(all, "worker-1") {
		t.Errorf("a clean log named:\n%s", all)
	}
}

// Pairings: a drafter in ASSIST and a worker in FULL_SERVICE naming each
// other pass; a one-sided pairing, a partner gone, failed or recovering,
// and a pairing of two full-service workers are caught.
func TestCheckerPairing(t *testing.T) {
	good := []TableSample{
		{At: 1, Rows: []WorkerRow{{ID: "w1", Phase: "FULL_SERVICE"}, {ID: "w2", Phase: "LOADING_DRAFT"}, {ID: "w3", Phase: "FULL_SERVICE"}}},
		{At: 2, Rows: []WorkerRow{{ID: "w1", Phase: "FULL_SERVICE", Paired: "w2"}, {ID: "w2", Phase: "ASSIST", Paired: "w1"}, {ID: "w3", Phase: "FULL_SERVICE"}}},
		// Unpaired in ASSIST: no partner free.
		{At: 3, Rows: []WorkerRow{{ID: "w1", Phase: "FAILED"}, {ID: "w2", Phase: "ASSIST"}, {ID: "w3", Phase: "HOTSWAP"}}},
	}
	if v := CheckPairing(good); !v.OK {
		t.Fatalf("valid pairings rejected: %v", v.Violations)
	}
	if v := CheckPairing(good); !strings.Contains(v.Note, "1 with a pairing, 1 distinct") {
		t.Fatalf("note %q", v.Note)
	}
	for name, rows := range map[string][]WorkerRow{
		"one-sided":           {{ID: "w1", Phase: "FULL_SERVICE"}, {ID: "w2", Phase: "ASSIST", Paired: "w1"}},
		"partner gone":        {{ID: "w2", Phase: "ASSIST", Paired: "w1"}},
		"partner failed":      {{ID: "w1", Phase: "FAILED", Paired: "w2"}, {ID: "w2", Phase: "ASSIST", Paired: "w1"}},
		"drafter in hotswap":  {{ID: "w1", Phase: "FULL_SERVICE", Paired: "w2"}, {ID: "w2", Phase: "HOTSWAP", Paired: "w1"}},
		"two in full service": {{ID: "w1", Phase: "FULL_SERVICE", Paired: "w2"}, {ID: "w2", Phase: "FULL_SERVICE", Paired: "w1"}},
		"paired elsewhere":    {{ID: "w1", Phase: "FULL_SERVICE", Paired: "w3"}, {ID: "w2", Phase: "ASSIST", Paired: "w1"}, {ID: "w3", Phase: "ASSIST", Paired: "w1"}},
	} {
		samples := append(append([]TableSample(nil), good...), TableSample{At: 4, Rows: rows})
		if v := CheckPairing(samples); v.OK {
			t.Errorf("%s: not caught", name)
		} else {
			t.Logf("%s: %v", name, v.Violations)
		}
	}
}

// Recovery: every worker back in FULL_SERVICE and unpaired passes; a killed
// worker stuck in a phase, one with no row, a pairing left over and an
// unreadable table are caught, with the reason.
func TestCheckerRecovered(t *testing.T) {
	all := []WorkerRow{{ID: "w1", Phase: "FULL_SERVICE"}, {ID: "w2", Phase: "FULL_SERVICE"}}
	ok := Recovered{Rows: all, Killed: map[string]int{"w2": 3}, Running: map[string]bool{"w1": true, "w2": true}}
	if v := CheckRecovered(ok); !v.OK {
		t.Fatalf("recovered cluster rejected: %v", v.Violations)
	}
	for name, c := range map[string]struct {
		r    Recovered
		want string
	}{
		"stuck in ASSIST": {Recovered{Rows: []WorkerRow{all[0], {ID: "w2", Phase: "ASSIST", Inc: 4}}, Killed: map[string]int{"w2": 1},
			Running: map[string]bool{"w1": true, "w2": true}, Logs: map[string]string{"w2": "could not read the model"}}, "w2 is in ASSIST (incarnation 4"},
		"dead in LOADING_DRAFT": {Recovered{Rows: []WorkerRow{all[0], {ID: "w2", Phase: "LOADING_DRAFT"}}, Killed: map[string]int{"w2": 1},
			Running: map[string]bool{"w1": true}}, "its process is not running"},
		"no row":       {Recovered{Rows: all[:1], Killed: map[string]int{"w2": 2}, Running: map[string]bool{"w1": true}}, "w2 was killed 2 times and has no row"},
		"pairing left": {Recovered{Rows: []WorkerRow{{ID: "w1", Phase: "FULL_SERVICE", Paired: "w2"}, all[1]}}, "still paired with w2"},
		"unreadable":   {Recovered{Err: "no leader"}, "could not be read"},
	} {
		v := CheckRecovered(c.r)
		if v.OK {
			t.Errorf("%s: not caught", name)
			continue
		}
		if !strings.Contains(strings.Join(v.Violations, "\n"), c.want) {
			t.Errorf("%s: %v, want %q", name, v.Violations, c.want)
		}
	}
}

// Migration events are counted by cause, a commit names its request, and
// a completed stream counts as migrated when its request or one of its
// attempts committed a migration.
func TestMigrationStats(t *testing.T) {
	s := newMigrationStats()
	ev := func(stage pb.Migration_Stage, id, reason string) *pb.Event {
		return &pb.Event{Body: &pb.Event_Migration{Migration: &pb.Migration{Stage: stage, Reason: reason,
			Placement: &pb.Placement{RequestId: id}}}}
	}
	committed := map[string]bool{}
	for _, e := range []*pb.Event{
		ev(pb.Migration_STAGE_STARTED, "cmpl-a", "operator"),
		ev(pb.Migration_STAGE_COMMITTED, "cmpl-a", "every page copied"),
		ev(pb.Migration_STAGE_STARTED, "cmpl-b~1", "operator"),
		ev(pb.Migration_STAGE_COMMITTED, "cmpl-b~1", "every page copied"),
		ev(pb.Migration_STAGE_STARTED, "j1-7", "operator"),
		ev(pb.Migration_STAGE_ABORTED, "j1-7", `worker: migration: no such request here under that epoch: request "j1-7", epoch 3`),
		{Body: &pb.Event_RecoveryPlan{RecoveryPlan: &pb.RecoveryPlan{Assignments: []*pb.RecoveryAssignment{{MigrationCopy: true}, {}}}}},
	} {
		if id := s.countMigration(e); id != "" {
			committed[id] = true
		}
	}
	if s.Started["operator"] != 3 || s.Committed != 2 || s.Aborted["worker"] != 1 || s.FromCopy != 1 {
		t.Fatalf("counted %s", s)
	}
	if want := "worker: migration: no such request here under that epoch: request ID, epoch N"; s.WorkerAborts[want] != 1 {
		t.Fatalf("worker aborts %v, want %q", s.WorkerAborts, want)
	}
	streams := []Stream{{ID: "cmpl-a", Done: true}, {ID: "cmpl-b", Done: true}, {ID: "cmpl-c", Done: true}, {ID: "cmpl-a", Done: false}}
	if n := streamsMigrated(streams, committed); n != 2 {
		t.Fatalf("%d completed streams migrated, want 2", n)
	}
}

// The Place stream's Complete is acknowledged without each id's outcome,
// and a GetPlacements batch reads several ids at one call and return: the
// model takes both, and catches a batch read that misses an acknowledged
// Dispatch or sees a completed placement, and a WORKER_UNAVAILABLE refusal
// of an id that is placed.
func TestLinearizablePlaceStreamAndBatches(t *testing.T) {
	unavailable := "rpc error: code = FailedPrecondition desc = fsm: chosen worker unavailable: worker w2 incarnation 1 is FAILED"
	ok := []Op{
		{Client: 0, Kind: Dispatch, ID: "a", Via: ViaPlace, Chose: "w1", ChoseInc: 1, Call: 0, Return: 10, Found: true, Worker: "w1", Inc: 1, Created: 5},
		{Client: 0, Kind: Dispatch, ID: "b", Via: ViaPlace, Chose: "w2", ChoseInc: 1, Call: 11, Return: 12, Err: unavailable, Refusal: "WORKER_UNAVAILABLE"},
		// One batch: a placed, b not (refused).
		{Client: 1, Kind: GetLin, ID: "a", Via: ViaBatch, Call: 13, Return: 14, Found: true, Worker: "w1", Inc: 1, Created: 5},
		{Client: 1, Kind: GetLin, ID: "b", Via: ViaBatch, Call: 13, Return: 14},
		{Client: 0, Kind: Complete, ID: "a", Via: ViaPlace, Call: 15, Return: 16},
		// Acknowledged completes of an absent or completed id change nothing.
		{Client: 0, Kind: Complete, ID: "a", Via: ViaPlace, Call: 17, Return: 18},
		{Client: 0, Kind: Complete, ID: "b", Via: ViaPlace, Call: 17, Return: 18},
		{Client: 1, Kind: GetLin, ID: "a", Via: ViaBatch, Call: 19, Return: 20},
		{Client: 1, Kind: GetLin, ID: "b", Via: ViaBatch, Call: 19, Return: 20},
		// A batch concurrent with an unanswered complete may see either.
		{Client: 0, Kind: Dispatch, ID: "c", Via: ViaPlace, Call: 21, Return: 22, Found: true, Worker: "w1", Inc: 1, Created: 9},
		{Client: 0, Kind: Complete, ID: "c", Via: ViaPlace, Call: 23, Return: Unknown, Indeterminate: true},
		{Client: 1, Kind: GetLin, ID: "c", Via: ViaBatch, Call: 24, Return: 25, Found: true, Worker: "w1", Inc: 1, Created: 9},
		{Client: 1, Kind: GetLin, ID: "c", Via: ViaBatch, Call: 26, Return: 27},
	}
	if v := CheckLinearizable(ok, "", time.Minute); !v.OK {
		t.Fatalf("valid history rejected: %v", v.Violations)
	}
	for name, ops := range map[string][]Op{
		"a batch read misses an acknowledged dispatch": {
			{Client: 0, Kind: Dispatch, ID: "a", Via: ViaPlace, Call: 0, Return: 10, Found: true, Worker: "w1", Created: 5},
			{Client: 1, Kind: GetLin, ID: "a", Via: ViaBatch, Call: 11, Return: 12},
		},
		"a batch read sees a placement completed on the stream": {
			{Client: 0, Kind: Dispatch, ID: "a", Via: ViaPlace, Call: 0, Return: 1, Found: true, Worker: "w1", Created: 5},
			{Client: 0, Kind: Complete, ID: "a", Via: ViaPlace, Call: 2, Return: 3},
			{Client: 1, Kind: GetLin, ID: "a", Via: ViaBatch, Call: 4, Return: 5, Found: true, Worker: "w1", Created: 5},
		},
		"WORKER_UNAVAILABLE, yet placed": {
			{Client: 0, Kind: Dispatch, ID: "a", Via: ViaPlace, Call: 0, Return: 1, Err: unavailable, Refusal: "WORKER_UNAVAILABLE"},
			{Client: 1, Kind: GetLin, ID: "a", Via: ViaBatch, Call: 2, Return: 3, Found: true, Worker: "w2", Created: 5},
		},
	} {
		if v := CheckLinearizable(ops, "", time.Minute); v.OK {
			t.Errorf("%s: not caught", name)
		}
	}
}

func TestCheckPlacePath(t *testing.T) {
	ok := []Op{
		{Kind: Dispatch, ID: "a", Via: ViaPlace, Chose: "w1", ChoseInc: 2, Found: true, Worker: "w1", Inc: 2, Created: 5, Index: 5},
		// Moved by the time a resent Dispatch answered: another worker, a
		// higher epoch.
		{Kind: Dispatch, ID: "b", Via: ViaPlace, Chose: "w1", ChoseInc: 2, Found: true, Worker: "w3", Inc: 1, Epoch: 1, Created: 6, Index: 6},
		{Kind: Dispatch, ID: "c", Via: ViaPlace, Chose: "w2", ChoseInc: 1, Dead: true, Err: "refused", Refusal: "WORKER_UNAVAILABLE"},
		{Kind: Dispatch, ID: "d", Via: ViaPlace, Chose: "w2", ChoseInc: 1, Dead: true, Indeterminate: true, Return: Unknown},
		{Kind: GetLin, ID: "a", Via: ViaBatch, Found: true},
	}
	if v := CheckPlacePath(ok); !v.OK {
		t.Fatalf("valid history rejected: %v", v.Violations)
	}
	for name, op := range map[string]Op{
		"placed elsewhere":         {Kind: Dispatch, ID: "a", Via: ViaPlace, Chose: "w1", ChoseInc: 2, Found: true, Worker: "w2", Inc: 1, Created: 5},
		"an older incarnation":     {Kind: Dispatch, ID: "a", Via: ViaPlace, Chose: "w1", ChoseInc: 2, Found: true, Worker: "w1", Inc: 1, Created: 5},
		"a dead incarnation":       {Kind: Dispatch, ID: "a", Via: ViaPlace, Chose: "w1", ChoseInc: 1, Dead: true, Found: true, Worker: "w1", Inc: 1, Created: 5},
		"a batch answer missing":   {Kind: GetLin, ID: "a", Via: ViaBatch, Err: malformedBatch + "0 placements and 0 not found for 1 ids, none for a"},
		"another request's answer": {Kind: Dispatch, ID: "a", Via: ViaPlace, Found: true, Worker: "w1", Inc: 1, Created: 5, Answered: "b"},
	} {
		if v := CheckPlacePath([]Op{op}); v.OK {
			t.Errorf("%s: not caught", name)
		}
	}
}

func TestCheckGatewayPath(t *testing.T) {
	streams := []Stream{{Accepted: true, Done: true}}
	fast := GatewayPaths{Counts: map[string]float64{gatewayCounters[0]: 3, gatewayCounters[1]: 1}}
	if v := CheckGatewayPath(fast, streams); !v.OK {
		t.Fatalf("a run that took the replica's path rejected: %v", v.Violations)
	}
	slow := GatewayPaths{Counts: map[string]float64{gatewayCounters[1]: 4}}
	if v := CheckGatewayPath(slow, streams); v.OK {
		t.Fatalf("a run whose gateways always waited for the commit passed: %s", v.Note)
	}
	if v := CheckGatewayPath(slow, nil); !v.OK {
		t.Fatalf("no stream completed, yet the path was judged: %v", v.Violations)
	}
	// Issue 21: a placement left unconfirmed past the dispatch deadline
	// fails the run, streams or not.
	for _, s := range [][]Stream{streams, nil} {
		unconfirmed := GatewayPaths{Counts: map[string]float64{gatewayCounters[0]: 3, unconfirmedCounter: 1}}
		if v := CheckGatewayPath(unconfirmed, s); v.OK {
			t.Fatalf("a run with a placement unconfirmed past %s passed: %s", unconfirmedBound, v.Note)
		}
	}
	// A failed scrape is not a pass: the counters it would have read are
	// unknown, whatever the others say.
	failed := GatewayPaths{Counts: map[string]float64{gatewayCounters[0]: 3}, ScrapeFails: []string{"gw-1: connection refused"}}
	if v := CheckGatewayPath(failed, streams); v.OK {
		t.Fatalf("a run with a failed scrape passed: %s", v.Note)
	}
	none := GatewayPaths{ScrapeFails: []string{"gw-0: connection refused"}}
	if v := CheckGatewayPath(none, streams); v.OK {
		t.Fatalf("a run whose only scrape failed passed: %s", v.Note)
	}
}
