package gateway

import "testing"

func TestTextStreamUTF8AndStops(t *testing.T) {
	ts := &textStream{stop: []string{"END"}}
	var got string
	for _, b := range []byte("héllo wEND orld") {
		d, stopped := ts.push([]byte{b})
		got += d
		if stopped {
			break
		}
	}
	if got != "héllo w" {
		t.Fatalf("text %q", got)
	}
	// A multi-byte rune split across tokens is emitted whole.
	ts = &textStream{}
	d1, _ := ts.push([]byte{0xc3})
	d2, _ := ts.push([]byte{0xa9})
	if d1 != "" || d2 != "é" {
		t.Fatalf("split rune: %q %q", d1, d2)
	}
	// A held-back prefix of a stop sequence that does not complete is emitted.
	ts = &textStream{stop: []string{"ab"}}
	d1, _ = ts.push([]byte("xa"))
	d2, _ = ts.push([]byte("c"))
	if d1 != "x" || d2 != "ac" {
		t.Fatalf("held back: %q %q", d1, d2)
	}
	if ts.flush() != "" {
		t.Fatal("nothing should remain")
	}
	// Invalid bytes are not held back.
	ts = &textStream{}
	if d, _ := ts.push([]byte{0xff}); d != "\xff" {
		t.Fatalf("invalid byte held back: %q", d)
	}
}

func TestJournalAcceptsInOrderOnly(t *testing.T) {
	e := &entry{}
	if ok, err := e.accept(0, 5); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if ok, err := e.accept(0, 5); ok || err != nil {
		t.Fatalf("repeat: %v %v", ok, err)
	}
	if _, err := e.accept(0, 6); err == nil {
		t.Fatal("conflicting repeat accepted")
	}
	if _, err := e.accept(2, 1); err == nil {
		t.Fatal("gap accepted")
	}
	if len(e.out) != 1 {
		t.Fatalf("journal %v", e.out)
	}
}
