package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// queueFull is what a worker whose waiting queue is at MaxWaiting answers
// Generate (worker/inference.go: core.ErrQueueFull).
var queueFull = status.Error(codes.ResourceExhausted, "worker: waiting queue full: 4096 requests wait, at its limit of 4096 (MaxWaiting, the worker's -max-waiting)")

// wantText waits for the completion and fails the test unless it ended
// with text, in full.
func wantText(t *testing.T, res <-chan *sse, text string) {
	t.Helper()
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != text {
		t.Fatalf("client got %q done=%v err=%v %s, want %q", got.text.String(), got.done, got.err, got.errMsg, text)
	}
}

// nextOrEnd waits for the next call at any of the rig's workers; it fails
// the test with the client's answer when the request ends first (never,
// with res nil).
func (r *rig) nextOrEnd(t *testing.T, res <-chan *sse) (string, *call) {
	t.Helper()
	select {
	case c := <-r.w["w1"].calls:
		return "w1", c
	case c := <-r.w["w2"].calls:
		return "w2", c
	case got := <-res:
		t.Fatalf("the request ended before another call: client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	case <-time.After(30 * time.Second):
		t.Fatal("no worker got a call")
	}
	return "", nil
}

// A worker whose queue is full refuses the request; the gateway places it
// on another worker, and the client sees a plain completion.
func TestQueueFullPlacesElsewhere(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	waitTable(t, r.g)
	res := r.complete(t, 2)
	full, c1 := r.nextAny(t)
	c1.fail(queueFull)
	other, c2 := r.nextOrEnd(t, res)
	if other == full {
		t.Fatalf("placed again on %s, the worker whose queue was full", full)
	}
	if c2.req.RequestId != c1.req.RequestId+"~1" {
		t.Fatalf("second call %q, want a new attempt %q", c2.req.RequestId, c1.req.RequestId+"~1")
	}
	c2.send(t, 0, 'a', false)
	c2.send(t, 1, 'b', true)
	wantText(t, res, "ab")
}

// When every worker's queue is full the client is told to come back: 429,
// OpenAI's rate-limit error, with Retry-After and a message that names the
// cause.
func TestQueueFullEverywhereAnswers429(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	waitTable(t, r.g)
	type answer struct {
		code       int
		retryAfter string
		body       []byte
		err        error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post("http://"+r.g.Addr()+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"lumen-tiny","prompt":"x","max_tokens":2,"stream":true}`))
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- answer{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: b, err: err}
	}()
	var seen []string
	for range 2 {
		var w string
		var c *call
		select {
		case c = <-r.w["w1"].calls:
			w = "w1"
		case c = <-r.w["w2"].calls:
			w = "w2"
		case a := <-done:
			t.Fatalf("answered after %v: %d %s", seen, a.code, a.body)
		case <-time.After(30 * time.Second):
			t.Fatal("no worker got a call")
		}
		seen = append(seen, w)
		c.fail(queueFull)
	}
	if slices.Sort(seen); !slices.Equal(seen, []string{"w1", "w2"}) {
		t.Fatalf("the request was tried on %v, want each worker once", seen)
	}
	var a answer
	select {
	case a = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("no answer")
	}
	if a.err != nil {
		t.Fatal(a.err)
	}
	var body struct {
		Error struct {
			Message, Type, Code string
		}
	}
	if err := json.Unmarshal(a.body, &body); err != nil {
		t.Fatalf("body %s: %v", a.body, err)
	}
	if a.code != 429 || body.Error.Type != "rate_limit_error" || a.retryAfter == "" ||
		!strings.Contains(body.Error.Message, "queue") || !strings.Contains(body.Error.Message, "retry") {
		t.Fatalf("got %d Retry-After %q: %s; want 429, rate_limit_error, a Retry-After and a message about full queues", a.code, a.retryAfter, a.body)
	}
	// The message passes on a worker's own answer, so the client (and a
	// benchmark's operator) sees which limit refused it.
	if !strings.Contains(body.Error.Message, "limit of 4096") || !strings.Contains(body.Error.Message, "-max-waiting") {
		t.Fatalf("429 message %q does not name the worker's limit (its answer: %s)", body.Error.Message, status.Convert(queueFull).Message())
	}
}

// A request that has streamed tokens is never failed for a full queue: a
// live migration lands it on a full worker, and it continues on another
// with its journal.
func TestQueueFullMidStreamResumesElsewhere(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	waitTable(t, r.g)
	res := r.complete(t, 2)
	src, c1 := r.nextAny(t)
	dst := map[string]string{"w1": "w2", "w2": "w1"}[src]
	c1.send(t, 0, 'a', false)
	c1.move(t, &pb.Placement{RequestId: c1.req.RequestId, WorkerId: dst, Epoch: 1})
	c2 := r.w[dst].next(t)
	c2.fail(queueFull)
	at, c3 := r.nextOrEnd(t, res)
	if at != src {
		t.Fatalf("resumed on %s, the worker whose queue was full", at)
	}
	if c3.req.RequestId != c1.req.RequestId+"~1" || !slices.Equal(c3.req.Generated, []int32{'a'}) {
		t.Fatalf("resumed call %q with generated %v, want %q with [a]", c3.req.RequestId, c3.req.Generated, c1.req.RequestId+"~1")
	}
	c3.send(t, 1, 'b', true)
	wantText(t, res, "ab")
}

// With every queue full mid-stream the request waits for one to free
// (trying again) instead of failing.
func TestQueueFullEverywhereMidStreamWaits(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	waitTable(t, r.g)
	res := r.complete(t, 2)
	src, c1 := r.nextAny(t)
	dst := map[string]string{"w1": "w2", "w2": "w1"}[src]
	c1.send(t, 0, 'a', false)
	c1.move(t, &pb.Placement{RequestId: c1.req.RequestId, WorkerId: dst, Epoch: 1})
	r.w[dst].next(t).fail(queueFull)
	if at, c := r.nextOrEnd(t, res); at != src {
		t.Fatalf("resumed on %s, the worker whose queue was full", at)
	} else {
		c.fail(queueFull) // every worker is full now
	}
	_, c := r.nextOrEnd(t, res) // tried again after a pause
	if !slices.Equal(c.req.Generated, []int32{'a'}) {
		t.Fatalf("resumed call %q with generated %v, want [a]", c.req.RequestId, c.req.Generated)
	}
	c.send(t, 1, 'b', true)
	wantText(t, res, "ab")
}

// With no load table the controller chooses, and it takes no exclusions:
// the gateway asks it again a few times (its view counts queues), then
// answers 429.
func TestQueueFullWithoutATableAsksTheController(t *testing.T) {
	r := newRig(t, 1, nil, nil) // the controller places everything on w1
	res := r.complete(t, 1)
	for i := range maxRefusals {
		at, c := r.nextOrEnd(t, res)
		if at != "w1" || c.req.Epoch != 1 {
			t.Fatalf("call %d at %s epoch %d, want the controller's placement on w1", i, at, c.req.Epoch)
		}
		c.fail(queueFull)
	}
	got := wait(t, res)
	if got.err == nil || !strings.Contains(got.err.Error(), "status 429") || !strings.Contains(got.err.Error(), "queue") {
		t.Fatalf("client got %q err=%v %s; want a 429 about full queues", got.text.String(), got.err, got.errMsg)
	}
	if n := len(r.fc.dispatchedIDs()); n != maxRefusals {
		t.Fatalf("%d Dispatches, want %d", n, maxRefusals)
	}
}
