package gateway

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// samplesResult is a streamed response of several choices, by index.
type samplesResult struct {
	text      map[int]string
	finish    map[int]string
	completed int // usage.completion_tokens
	done      bool
	err       error
}

// completeN posts a streaming completion of n samples and reads it to the
// end, each chunk's text put under its choice's index.
func (r *rig) completeN(body string) <-chan *samplesResult {
	out := make(chan *samplesResult, 1)
	go func() {
		res := &samplesResult{text: map[int]string{}, finish: map[int]string{}}
		defer func() { out <- res }()
		resp, err := (&http.Client{Timeout: 60 * time.Second}).Post("http://"+r.g.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			res.err = err
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			res.err = fmt.Errorf("status %d", resp.StatusCode)
			return
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if line == "[DONE]" {
				res.done = true
				return
			}
			var ev struct {
				Choices []struct {
					Index  int     `json:"index"`
					Text   string  `json:"text"`
					Finish *string `json:"finish_reason"`
				} `json:"choices"`
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
				Error any `json:"error"`
			}
			if err := json.Unmarshal([]byte(line), &ev); err != nil || ev.Error != nil {
				res.err = fmt.Errorf("event %s: %v", line, err)
				return
			}
			for _, c := range ev.Choices {
				if _, over := res.finish[c.Index]; over {
					res.err = fmt.Errorf("choice %d has a chunk after its finish: %s", c.Index, line)
					return
				}
				res.text[c.Index] += c.Text
				if c.Finish != nil {
					res.finish[c.Index] = *c.Finish
				}
			}
			if ev.Usage != nil {
				res.completed = ev.Usage.CompletionTokens
			}
		}
		res.err = sc.Err()
	}()
	return out
}

// n samples are n requests to the cluster, each its own placement, seed
// (the request's plus its index) and journal: one of them moved mid-stream
// resumes with its own history, and the client gets every choice whole,
// with no chunk after its finish and the usage of all of them.
func TestSamplesStreamSideBySide(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	res := r.completeN(`{"model":"lumen-tiny","prompt":"x","max_tokens":3,"n":2,"seed":5,"stream":true,"stream_options":{"include_usage":true}}`)
	a, b := r.w["w1"].next(t), r.w["w1"].next(t)
	if a.req.Sampling.Seed > b.req.Sampling.Seed {
		a, b = b, a
	}
	if a.req.Sampling.Seed != 5 || b.req.Sampling.Seed != 6 {
		t.Fatalf("the samples' seeds are %d and %d, want 5 and 6", a.req.Sampling.Seed, b.req.Sampling.Seed)
	}
	ia, ib := strings.HasSuffix(a.req.RequestId, "-0"), strings.HasSuffix(b.req.RequestId, "-1")
	if !ia || !ib || strings.TrimSuffix(a.req.RequestId, "-0") != strings.TrimSuffix(b.req.RequestId, "-1") {
		t.Fatalf("request ids %q and %q, want one id with -0 and -1", a.req.RequestId, b.req.RequestId)
	}
	a.send(t, 0, 'a', false)
	b.send(t, 0, 'x', false)
	a.send(t, 1, 'b', false)
	// Sample 1 moves: its destination gets its own history, not sample 0's.
	b.move(t, &pb.Placement{RequestId: b.req.RequestId, WorkerId: "w2", Epoch: 2})
	c := r.w["w2"].next(t)
	if string(int32s(c.req.Generated)) != "x" || c.req.Sampling.Seed != 6 {
		t.Fatalf("the moved sample's call: history %q seed %d, want \"x\" and 6", string(int32s(c.req.Generated)), c.req.Sampling.Seed)
	}
	a.send(t, 2, 'c', true)
	c.send(t, 1, 'y', false)
	c.send(t, 2, 'z', true)
	got := <-res
	if got.err != nil || !got.done {
		t.Fatalf("the response: err %v, done %v", got.err, got.done)
	}
	if got.text[0] != "abc" || got.text[1] != "xyz" || len(got.text) != 2 {
		t.Fatalf("choices %v, want 0: abc, 1: xyz", got.text)
	}
	if got.finish[0] != "length" || got.finish[1] != "length" || got.completed != 6 {
		t.Fatalf("finish reasons %v, completion tokens %d; want length (max_tokens), twice, and 6", got.finish, got.completed)
	}
	// Each sample's attempts are completed on its own.
	want := []string{a.req.RequestId, b.req.RequestId}
	waitFor(t, 10*time.Second, "both samples completed", func() bool {
		ids := r.fc.completedIDs()
		return slices.Contains(ids, want[0]) && slices.Contains(ids, want[1])
	})
}

// best_of draws best_of samples (each its own request, seed plus index,
// asking the worker for its tokens' logprobs) and returns the n with the
// highest cumulative logprob, best first, indexed from 0, without logprobs
// unless asked for; usage counts every sample drawn, as OpenAI bills it.
func TestBestOfReturnsTheLikeliest(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	type answer struct {
		Choices []struct {
			Index    int    `json:"index"`
			Text     string `json:"text"`
			Logprobs any    `json:"logprobs"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	res := make(chan answer, 1)
	go func() {
		var a answer
		defer func() { res <- a }()
		resp, err := http.Post("http://"+r.g.Addr()+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"lumen-tiny","prompt":"x","max_tokens":2,"n":2,"best_of":3,"seed":9}`))
		if err != nil {
			t.Error(err)
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("status %d", resp.StatusCode)
			return
		}
		if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
			t.Error(err)
		}
	}()
	calls := map[uint64]*call{}
	for range 3 {
		c := r.w["w1"].next(t)
		if !c.req.Logprobs {
			t.Fatalf("sample seed %d: the worker was not asked for logprobs, which best_of ranks by", c.req.Sampling.Seed)
		}
		calls[c.req.Sampling.Seed] = c
	}
	// Cumulative logprobs: seed 9 -3.0, seed 10 -0.5, seed 11 -1.0.
	for seed, toks := range map[uint64][2]float32{9: {-1, -2}, 10: {-0.25, -0.25}, 11: {-0.5, -0.5}} {
		c := calls[seed]
		if c == nil {
			t.Fatalf("no sample with seed %d among %v", seed, calls)
		}
		c.sendLogprob(t, 0, 'a'+int32(seed-9), toks[0], false)
		c.sendLogprob(t, 1, 'a'+int32(seed-9), toks[1], true)
	}
	a := <-res
	if len(a.Choices) != 2 || a.Choices[0].Index != 0 || a.Choices[1].Index != 1 {
		t.Fatalf("choices %+v, want 2 indexed 0 and 1", a.Choices)
	}
	if a.Choices[0].Text != "bb" || a.Choices[1].Text != "cc" {
		t.Fatalf("returned %q then %q, want the two likeliest best first: \"bb\" (-0.5) then \"cc\" (-1.0)", a.Choices[0].Text, a.Choices[1].Text)
	}
	if a.Choices[0].Logprobs != nil {
		t.Fatalf("logprobs %v returned unasked", a.Choices[0].Logprobs)
	}
	if a.Usage.CompletionTokens != 6 {
		t.Fatalf("completion tokens %d, want the 3 samples' 6", a.Usage.CompletionTokens)
	}
}

// With prefix routing the samples of one request share its prompt's
// cached pages: sample 0 runs alone until its first token (its prompt's
// full pages are then in its worker's cache), and the others are placed
// on that worker — their Dispatches name it — though the other worker is
// freer, each with its own seed. A prompt with no full page has nothing to
// share: its samples start together.
func TestSamplesShareTheFirstSamplesWorker(t *testing.T) {
	r, st := newKVRig(t, true)
	waitTable(t, r.g)
	// w2 is freer by 10 pages a request: sample 0 goes there, and with no
	// placement counted the next would go to w1.
	setLoads(t, r, st, 100, 90, 0)
	prompt, _ := prefixPrompt()
	res := r.completeN(fmt.Sprintf(`{"model":"lumen-tiny","prompt":%q,"max_tokens":2,"n":3,"seed":5,"stream":true}`, prompt))
	w0, c0 := r.nextAny(t)
	if !strings.HasSuffix(c0.req.RequestId, "-0") || c0.req.Sampling.Seed != 5 {
		t.Fatalf("first call %s seed %d, want sample 0 with seed 5", c0.req.RequestId, c0.req.Sampling.Seed)
	}
	select {
	case c := <-r.w["w1"].calls:
		t.Fatalf("%s called before sample 0's first token", c.req.RequestId)
	case c := <-r.w["w2"].calls:
		t.Fatalf("%s called before sample 0's first token", c.req.RequestId)
	case <-time.After(200 * time.Millisecond):
	}
	c0.send(t, 0, 'a', false)
	seeds := map[uint64]bool{}
	var others []*call
	for range 2 {
		w, c := r.nextAny(t)
		if w != w0 {
			t.Fatalf("sample %s went to %s, sample 0 runs on %s", c.req.RequestId, w, w0)
		}
		id := c.req.RequestId
		waitFor(t, 10*time.Second, "the sample's Dispatch", func() bool { return st.named(id) != "" })
		if n := st.named(id); n != w0 {
			t.Fatalf("sample %s's Dispatch named %q, want %s", id, n, w0)
		}
		seeds[c.req.Sampling.Seed] = true
		others = append(others, c)
	}
	if !seeds[6] || !seeds[7] {
		t.Fatalf("the other samples' seeds %v, want 6 and 7", seeds)
	}
	c0.send(t, 1, 'b', true)
	for _, c := range others {
		c.send(t, 0, 'x', false)
		c.send(t, 1, 'y', true)
	}
	if got := <-res; got.err != nil || !got.done || got.text[0] != "ab" || got.text[1] != "xy" || got.text[2] != "xy" {
		t.Fatalf("the response: %v, err %v, done %v", got.text, got.err, got.done)
	}

	// A prompt shorter than a page: the samples start together.
	res = r.completeN(`{"model":"lumen-tiny","prompt":"x","max_tokens":1,"n":2,"stream":true}`)
	_, a := r.nextAny(t)
	_, b := r.nextAny(t)
	a.send(t, 0, 'a', true)
	b.send(t, 0, 'b', true)
	if got := <-res; got.err != nil || !got.done {
		t.Fatalf("the short prompt's response: %v, err %v", got.text, got.err)
	}
}
