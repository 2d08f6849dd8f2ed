package gateway

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestUnknownRoutesAnswerJSON: an unknown path is a 404 and a method the
// path does not take a 405 with Allow, both as OpenAI's JSON error with its
// four fields.
func TestUnknownRoutesAnswerJSON(t *testing.T) {
	h := newTestGateway(t, nil).Handler()
	for _, c := range []struct {
		method, path string
		code         int
		allow, msg   string
		errCode      string
	}{
		{"POST", "/v1/embeddings", 404, "", "Invalid URL (POST /v1/embeddings)", "unknown_url"},
		{"GET", "/", 404, "", "Invalid URL (GET /)", "unknown_url"},
		{"GET", "/v1/completions", 405, "POST", "Invalid method (GET /v1/completions): /v1/completions takes POST", "method_not_allowed"},
		{"DELETE", "/v1/models", 405, "GET, HEAD", "/v1/models takes GET, HEAD", "method_not_allowed"},
	} {
		req := httptest.NewRequest(c.method, c.path, nil)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var body struct {
			Error map[string]any `json:"error"`
		}
		err := json.Unmarshal(rec.Body.Bytes(), &body)
		msg, _ := body.Error["message"].(string)
		if err != nil || rec.Code != c.code || rec.Header().Get("Allow") != c.allow || !strings.Contains(msg, c.msg) ||
			body.Error["code"] != c.errCode || body.Error["type"] != "invalid_request_error" || rec.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d Allow %q %s (%v); want %d Allow %q, %q", c.method, c.path, rec.Code, rec.Header().Get("Allow"),
				rec.Body.String(), err, c.code, c.allow, c.msg)
		}
		if _, ok := body.Error["param"]; !ok {
			t.Errorf("%s %s: no param field in %s", c.method, c.path, rec.Body.String())
		}
	}
	// Routes still route.
	req := httptest.NewRequest("GET", "/v1/models", nil)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), "lumen-tiny") {
		t.Fatalf("GET /v1/models: %d %s", rec.Code, rec.Body.String())
	}
}
