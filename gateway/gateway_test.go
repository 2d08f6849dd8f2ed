package gateway

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newTestGateway serves the API with a controller address nobody answers:
// enough for every error that is decided before placement, and for 503.
func newTestGateway(t *testing.T, tweak func(*Config)) *Gateway {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Addr, cfg.Controllers, cfg.Logger = "127.0.0.1:0", []string{"127.0.0.1:1"}, hclog.NewNullLogger()
	cfg.DispatchTimeout = time.Second
	if tweak != nil {
		tweak(&cfg)
	}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	return g
}

func post(t *testing.T, h http.Handler, path, body string, hdr ...string) (int, map[string]any) {
	t.Helper()
	req := httptest.NewRequest("POST", path, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	var out map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &out)
	return rec.Code, out
}

func errorOf(body map[string]any) (msg, param string) {
	e, _ := body["error"].(map[string]any)
	msg, _ = e["message"].(string)
	param, _ = e["param"].(string)
	return
}

func TestErrors(t *testing.T) {
	g := newTestGateway(t, nil)
	h := g.Handler()
	cases := []struct {
		name, path, body string
		code             int
		param, msg       string
	}{
		{"malformed JSON", "/v1/completions", `{"model":`, 400, "", "not valid JSON"},
		{"empty body", "/v1/completions", ``, 400, "", "body is empty"},
		{"wrong type", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":"ten"}`, 400, "max_tokens", "max_tokens must be an integer"},
		{"wrong type temperature", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","temperature":"hot"}`, 400, "temperature", "must be a number"},
		{"no model", "/v1/completions", `{"prompt":"x"}`, 400, "model", "you must provide a model"},
		{"unknown model", "/v1/completions", `{"model":"gpt-4","prompt":"x"}`, 404, "model", "the model `gpt-4` does not exist"},
		{"no prompt", "/v1/completions", `{"model":"lumen-tiny"}`, 400, "prompt", "you must provide a prompt"},
		{"empty prompt", "/v1/completions", `{"model":"lumen-tiny","prompt":""}`, 400, "prompt", "prompt is empty"},
		{"empty token prompt", "/v1/completions", `{"model":"lumen-tiny","prompt":[]}`, 400, "prompt", "prompt is empty"},
		{"batch prompt", "/v1/completions", `{"model":"lumen-tiny","prompt":["a","b"]}`, 400, "prompt", "batches of 2 prompts"},
		{"bad token id", "/v1/completions", `{"model":"lumen-tiny","prompt":[1,2,400]}`, 400, "prompt", "prompt[2] = 400 is not a token id"},
		{"negative token id", "/v1/completions", `{"model":"lumen-tiny","prompt":[-1]}`, 400, "prompt", "prompt[0] = -1 is not a token id"},
		{"max_tokens beyond context", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":5000}`, 400, "max_tokens", "context is 2048 tokens"},
		{"prompt beyond context", "/v1/completions", `{"model":"lumen-tiny","prompt":"` + strings.Repeat("a", 2100) + `"}`, 400, "prompt", "the prompt has 2100"},
		{"temperature", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","temperature":2.5}`, 400, "temperature", "between 0 and 2"},
		{"top_p", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","top_p":0}`, 400, "top_p", "greater than 0"},
		{"n", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","n":0}`, 400, "n", "n must be between 1 and 128, got 0"},
		{"n too large", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","n":129}`, 400, "n", "n must be between 1 and 128, got 129"},
		{"best_of below n", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","n":3,"best_of":2}`, 400, "best_of", "best_of must be between n (3) and 128, got 2"},
		{"best_of too large", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","best_of":129}`, 400, "best_of", "between n (1) and 128, got 129"},
		{"best_of streamed", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","best_of":2,"stream":true}`, 400, "best_of", "cannot be streamed"},
		{"best_of in chat", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"best_of":2}`, 400, "best_of", "a parameter of /v1/completions"},
		{"echo in chat", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"echo":true}`, 400, "echo", "a parameter of /v1/completions"},
		{"max_tokens 0 without echo", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":0}`, 400, "max_tokens", "0 only with echo"},
		{"suffix", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","suffix":"end"}`, 400, "suffix", "suffix is not supported"},
		{"presence_penalty", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","presence_penalty":0.5}`, 400, "presence_penalty", "got 0.5"},
		{"logit_bias", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","logit_bias":{"5":-100}}`, 400, "logit_bias", "logits are not biased"},
		{"chat tools", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}`, 400, "tools", "tool calling"},
		{"chat json mode", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}`, 400, "response_format", "structured output"},
		{"priority below the range", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","priority":-101}`, 400, "priority", "priority must be between -100 and 100"},
		{"priority above the range", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"priority":1000}`, 400, "priority", "got 1000"},
		{"priority not an integer", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","priority":"high"}`, 400, "priority", "priority must be an integer"},
		{"priority accepted", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":1,"priority":-1}`, 503, "", "has no controller session"},
		{"too many stops", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","stop":["a","b","c","d","e"]}`, 400, "stop", "at most 4"},
		{"empty stop", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","stop":""}`, 400, "stop", "stop[0] must be 1..64 bytes"},
		{"stream_options without stream", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","stream_options":{"include_usage":true}}`, 400, "stream_options", "only allowed when stream"},
		{"chat without messages", "/v1/chat/completions", `{"model":"lumen-tiny"}`, 400, "messages", "at least one message"},
		{"chat bad role", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"robot","content":"x"}]}`, 400, "messages", `messages[0].role "robot"`},
		{"chat image part", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, 400, "messages", "only text"},
		{"chat with prompt", "/v1/chat/completions", `{"model":"lumen-tiny","prompt":"x","messages":[{"role":"user","content":"x"}]}`, 400, "prompt", "take messages, not prompt"},
		{"no controller", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":1}`, 503, "", "has no controller session"},
	}
	for _, c := range cases {
		start := time.Now()
		code, body := post(t, h, c.path, c.body)
		msg, param := errorOf(body)
		if code != c.code || param != c.param || !strings.Contains(msg, c.msg) {
			t.Errorf("%s: %d param %q %q, want %d param %q containing %q", c.name, code, param, msg, c.code, c.param, c.msg)
		}
		if time.Since(start) > 30*time.Second {
			t.Errorf("%s: took %s", c.name, time.Since(start))
		}
	}
}

func TestAuthBodyLimitAndAdmission(t *testing.T) {
	g := newTestGateway(t, func(c *Config) {
		c.APIKeys = []string{"sk-1"}
		c.MaxBodyBytes = 100
		c.MaxConcurrent = 1
	})
	h := g.Handler()
	ok := `{"model":"lumen-tiny","prompt":"x"}`
	if code, body := post(t, h, "/v1/completions", ok); code != 401 {
		t.Fatalf("no key: %d %v", code, body)
	}
	if code, _ := post(t, h, "/v1/completions", ok, "Authorization", "Bearer sk-2"); code != 401 {
		t.Fatalf("wrong key: %d", code)
	}
	big := `{"model":"lumen-tiny","prompt":"` + strings.Repeat("x", 200) + `"}`
	if code, body := post(t, h, "/v1/completions", big, "Authorization", "Bearer sk-1"); code != 413 {
		t.Fatalf("big body: %d %v", code, body)
	} else if msg, _ := errorOf(body); !strings.Contains(msg, "exceeds 100 bytes") {
		t.Fatalf("big body message %q", msg)
	}
	g.admit <- struct{}{} // the one slot is taken
	code, body := post(t, h, "/v1/completions", ok, "Authorization", "Bearer sk-1")
	<-g.admit
	if msg, _ := errorOf(body); code != 429 || !strings.Contains(msg, "limit") {
		t.Fatalf("admission: %d %q", code, msg)
	}
	// Two samples need two slots: refused whole, and the one it could
	// take is given back.
	code, body = post(t, h, "/v1/completions", `{"model":"lumen-tiny","prompt":"x","n":2}`, "Authorization", "Bearer sk-1")
	if msg, _ := errorOf(body); code != 429 || !strings.Contains(msg, "n samples counts n") || len(g.admit) != 0 {
		t.Fatalf("admission of n=2 with one slot: %d %q, %d slots held after", code, msg, len(g.admit))
	}
	req := httptest.NewRequest("GET", "/v1/models", nil)
	req.Header.Set("Authorization", "Bearer sk-1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != 200 || !bytes.Contains(rec.Body.Bytes(), []byte(`"lumen-tiny"`)) {
		t.Fatalf("models: %d %s", rec.Code, rec.Body)
	}
}

// FuzzDecodeRequest feeds arbitrary bodies to the decoder and validator:
// they never panic, and every refusal is a 400 with a message.
func FuzzDecodeRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"lumen-tiny","prompt":"hello","max_tokens":8,"temperature":0.5,"stop":["\n"]}`,
		`{"model":"lumen-tiny","prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"lumen-tiny","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":4}`,
		`{"model":"lumen-tiny","prompt":[[1,2]],"seed":7,"top_p":0.9,"n":1}`,
		`{"prompt":{"nested":true}}`, `[]`, `null`, `{"max_tokens":1e309}`,
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		req, err := decodeRequest(bytes.NewReader(body))
		if err != nil {
			ae, ok := err.(*apiError)
			if !ok || ae.Status != 400 || ae.Message == "" {
				t.Fatalf("decode error %#v", err)
			}
			return
		}
		if _, ae := req.validate(chat, 16); ae != nil && (ae.Status != 400 || ae.Message == "") {
			t.Fatalf("validate error %#v", ae)
		}
	})
}

// TestUnsupportedAtDefaults: the unsupported parameters at their no-op
// values (what SDKs and harnesses send when the feature is off) are served.
func TestUnsupportedAtDefaults(t *testing.T) {
	for _, body := range []string{
		`{"model":"lumen-tiny","prompt":"x","echo":false,"best_of":1,"suffix":null,"logit_bias":{},"presence_penalty":0,"frequency_penalty":0.0,"min_tokens":0}`,
		`{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"tools":[],"response_format":{ "type" : "text" },"repetition_penalty":1}`,
		`{"model":"lumen-tiny","prompt":"x","n":3,"best_of":3}`,
	} {
		req, err := decodeRequest(strings.NewReader(body))
		if err != nil {
			t.Fatalf("%s: decode: %v", body, err)
		}
		if _, ae := req.validate(req.Prompt == nil, 16); ae != nil {
			t.Errorf("%s: refused: %s (param %s)", body, ae.Message, ae.Param)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name  string
		tweak func(*Config)
		want  string
	}{
		{"zero concurrency", func(c *Config) { c.MaxConcurrent = 0 }, "MaxConcurrent (0) must be at least 1"},
		{"no controllers", func(c *Config) { c.Controllers = nil }, "at least one controller address is required"},
		{"half TLS", func(c *Config) { c.TLSCert = "cert.pem" }, "-tls-cert and -tls-key must be given together"},
		{"zero context", func(c *Config) { c.MaxContext = 0 }, "MaxContext (0) must be at least 1 token"},
		{"zero body", func(c *Config) { c.MaxBodyBytes = 0 }, "MaxBodyBytes (0) must be at least 1"},
		{"no resume timeout", func(c *Config) { c.ResumeTimeout = 0 }, "ResumeTimeout (0s) and DispatchTimeout (10s) must be positive"},
		{"keepalive too often", func(c *Config) { c.KeepaliveTime = time.Second }, "KeepaliveTime (1s) cannot be below 10s"},
		{"no probe interval", func(c *Config) { c.WatchProbeInterval = 0 }, "WatchProbeInterval (0s) must be positive"},
		{"no model", func(c *Config) { c.Model = "" }, "a Model name is required"},
	}
	for _, c := range cases {
		cfg := DefaultConfig()
		cfg.Addr, cfg.Controllers, cfg.Logger = "127.0.0.1:0", []string{"127.0.0.1:1"}, hclog.NewNullLogger()
		c.tweak(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "gateway: invalid config: ") {
			t.Errorf("%s: %v, want an error containing %q", c.name, err, c.want)
			continue
		}
		if g, err := New(cfg); err == nil {
			g.Close()
			t.Errorf("%s: New accepted the config", c.name)
		}
	}
	cfg := DefaultConfig()
	cfg.Controllers = []string{"127.0.0.1:1"}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the defaults with a controller: %v", err)
	}
}
