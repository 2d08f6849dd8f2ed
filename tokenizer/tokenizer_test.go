package tokenizer

import "testing"

func TestTokenizerRoundTrip(t *testing.T) {
	var tk Tokenizer
	for _, s := range []string{"", "hello", "héllo ✓", "<|eos|> is just text here", "\x00\xff"} {
		if got := tk.Decode(tk.Encode(s)); got != s {
			t.Errorf("round trip of %q gave %q", s, got)
		}
	}
	ids := tk.ApplyChatTemplate([]Message{{Role: "user", Content: "hi"}})
	want := "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
	if got := tk.Decode(ids); got != want {
		t.Fatalf("template %q, want %q", got, want)
	}
	if ids[0] != TokBOS || tk.Encode("<|eos|>")[0] == TokEOS {
		t.Fatal("special token spelled in text became a special token")
	}
}

func TestDecodeSpecialAndUnused(t *testing.T) {
	var tk Tokenizer
	got := tk.Decode([]int32{'a', TokEOS, FirstUnused, 'b', TokImEnd})
	if want := "a<|eos|><|261|>b<|im_end|>"; got != want {
		t.Fatalf("decode %q, want %q", got, want)
	}
	if tk.DecodeToken(TokEOS) != "" || tk.DecodeToken('x') != "x" || tk.DecodeToken(-1) != "" {
		t.Fatal("DecodeToken renders bytes only")
	}
}
