package completions

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// serve answers every POST /v1/completions with status and body, and
// records the request body.
func serve(t *testing.T, status int, body string) (addr string, got *string) {
	t.Helper()
	got = new(string)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != "POST" || r.URL.Path != "/v1/completions" || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "wrong request", 400)
			return
		}
		b, _ := io.ReadAll(r.Body)
		*got = string(b)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(status)
		fmt.Fprint(w, body)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), got
}

func TestStreamTokensUsageDone(t *testing.T) {
	addr, sent := serve(t, 200, ": keepalive\n\n"+
		`data: {"id":"cmpl-1","choices":[{"index":0,"text":"Hel"}]}`+"\n\n"+
		`data:{"id":"cmpl-1","choices":[{"index":0,"text":"lo"}]}`+"\n\n"+
		"event: ignored\n"+
		`data: {"id":"cmpl-1","choices":[{"index":0,"text":"","finish_reason":"length"}]}`+"\n\n"+
		`data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}`+"\n\n"+
		"data: [DONE]\n\n")
	var chunks []Chunk
	res, err := Stream(context.Background(), http.DefaultClient, addr, Body("Hi", 2, true), func(c Chunk) { chunks = append(chunks, c) })
	if err != nil {
		t.Fatal(err)
	}
	if !res.Accepted || !res.Done || res.ID != "cmpl-1" || res.Text != "Hello" {
		t.Fatalf("result %+v", res)
	}
	if res.Usage == nil || res.Usage.CompletionTokens != 2 || res.Usage.PromptTokens != 3 {
		t.Fatalf("usage %+v", res.Usage)
	}
	if len(chunks) != 4 || chunks[0].Text != "Hel" || chunks[1].Text != "lo" || chunks[3].Usage == nil {
		t.Fatalf("chunks %+v", chunks)
	}
	want := `{"max_tokens":2,"model":"lumen-tiny","prompt":"Hi","stream":true,"stream_options":{"include_usage":true},"temperature":0}`
	if *sent != want {
		t.Fatalf("sent %s\nwant %s", *sent, want)
	}
}

func TestBodyTokenPromptWithoutUsage(t *testing.T) {
	want := `{"max_tokens":4,"model":"lumen-tiny","prompt":[97,98],"stream":true,"temperature":0}`
	if got := string(Body([]int32{97, 98}, 4, false)); got != want {
		t.Fatalf("got %s\nwant %s", got, want)
	}
}

func TestStreamErrorEvent(t *testing.T) {
	addr, _ := serve(t, 200, `data: {"id":"c","choices":[{"text":"ab"}]}`+"\n\n"+
		`data: {"error":{"message":"resume deadline exceeded","type":"server_error"}}`+"\n\n")
	res, err := Stream(context.Background(), http.DefaultClient, addr, Body("x", 4, false), nil)
	var ee *EventError
	if !errors.As(err, &ee) || ee.Message != "resume deadline exceeded" {
		t.Fatalf("err %v, want an EventError", err)
	}
	if !res.Accepted || res.Done || res.Text != "ab" {
		t.Fatalf("result %+v", res)
	}
}

func TestStreamCutWithoutDone(t *testing.T) {
	addr, _ := serve(t, 200, `data: {"id":"c","choices":[{"text":"ab"}]}`+"\n\n")
	res, err := Stream(context.Background(), http.DefaultClient, addr, Body("x", 4, false), nil)
	if !errors.Is(err, ErrNoDone) {
		t.Fatalf("err %v, want ErrNoDone", err)
	}
	if !res.Accepted || res.Done || res.Text != "ab" {
		t.Fatalf("result %+v", res)
	}
}

func TestStreamMalformedLine(t *testing.T) {
	addr, _ := serve(t, 200, `data: {"id":"c","choices":[{"text":"ab"}]}`+"\n\n"+"data: {not json\n\n"+"data: [DONE]\n\n")
	res, err := Stream(context.Background(), http.DefaultClient, addr, Body("x", 4, false), nil)
	if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "{not json") {
		t.Fatalf("err %v, want ErrMalformed naming the line", err)
	}
	if res.Done || res.Text != "ab" {
		t.Fatalf("result %+v", res)
	}
}

func TestStreamHTTPError(t *testing.T) {
	addr, _ := serve(t, 429, `{"error":{"message":"too many requests"}}`+"\n")
	res, err := Stream(context.Background(), http.DefaultClient, addr, Body("x", 4, false), nil)
	var he *HTTPError
	if !errors.As(err, &he) || he.Status != 429 || he.Body != `{"error":{"message":"too many requests"}}` {
		t.Fatalf("err %v, want HTTPError 429", err)
	}
	if res.Accepted {
		t.Fatal("a refused request counts as accepted")
	}
	if err.Error() != `HTTP 429: {"error":{"message":"too many requests"}}` {
		t.Fatalf("message %q", err.Error())
	}
}

func TestStreamTransportError(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	addr, _ := serve(t, 200, "data: [DONE]\n\n")
	res, err := Stream(ctx, http.DefaultClient, addr, Body("x", 4, false), nil)
	if !errors.Is(err, context.Canceled) || res.Accepted {
		t.Fatalf("err %v, result %+v", err, res)
	}
}
