package jepsen

import (
	"bufio"
	"errors"
	"net"
	"os"
	"testing"
	"time"
)

// echoServer answers every line with the line, upper-cased first byte.
func echoServer(t *testing.T) (addr string, got chan string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	got = make(chan string, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					line := sc.Text()
					got <- line
					if _, err := c.Write([]byte("re:" + line + "\n")); err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String(), got
}

// A cut link carries nothing in its direction, in either connection
// direction, and heals with the stalled bytes delivered in order; the other
// links keep working meanwhile.
func TestProxiesCutAndHeal(t *testing.T) {
	raft1, got1 := echoServer(t)
	grpc0, got0 := echoServer(t)
	targets := map[int][2]string{0: {"127.0.0.1:1", grpc0}, 1: {raft1, "127.0.0.1:1"}}
	px, err := NewProxies(2, func(j int) string { return targets[j][0] }, func(j int) string { return targets[j][1] })
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()

	dial := func(addr string) (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c, bufio.NewReader(c)
	}
	send := func(c net.Conn, s string) {
		if _, err := c.Write([]byte(s + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	recv := func(r *bufio.Reader, c net.Conn, within time.Duration) (string, error) {
		c.SetReadDeadline(time.Now().Add(within))
		defer c.SetReadDeadline(time.Time{})
		s, err := r.ReadString('\n')
		return s, err
	}
	arrives := func(ch chan string, want string) {
		t.Helper()
		select {
		case s := <-ch:
			if s != want {
				t.Fatalf("got %q, want %q", s, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%q never arrived", want)
		}
	}
	stalled := func(ch chan string) {
		t.Helper()
		select {
		case s := <-ch:
			t.Fatalf("%q crossed a cut link", s)
		case <-time.After(300 * time.Millisecond):
		}
	}

	// Controller 0 -> controller 1's Raft, both directions open.
	c01, r01 := dial(px.RaftAddr(0, 1))
	send(c01, "a")
	arrives(got1, "a")
	if s, err := recv(r01, c01, 5*time.Second); err != nil || s != "re:a\n" {
		t.Fatalf("reply %q, %v", s, err)
	}

	// 0 -> 1 cut: 0's bytes stall; the client link to 0 still works.
	if err := px.Cut(0, 1); err != nil {
		t.Fatal(err)
	}
	send(c01, "b")
	stalled(got1)
	cc, rc := dial(px.ClientAddr(0))
	send(cc, "client")
	arrives(got0, "client")
	if s, err := recv(rc, cc, 5*time.Second); err != nil || s != "re:client\n" {
		t.Fatalf("client reply %q, %v", s, err)
	}
	if px.Cuts() != 1 {
		t.Fatalf("%d cuts, want 1", px.Cuts())
	}
	px.Heal()
	arrives(got1, "b")
	if s, err := recv(r01, c01, 5*time.Second); err != nil || s != "re:b\n" {
		t.Fatalf("reply after heal %q, %v", s, err)
	}

	// 1 -> 0 cut (one way): 0's request arrives, 1's reply stalls.
	px.Cut(1, 0)
	send(c01, "c")
	arrives(got1, "c")
	if s, err := recv(r01, c01, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("reply %q crossed the cut 1 -> 0 (%v)", s, err)
	}
	px.Heal()
	if s, err := recv(r01, c01, 5*time.Second); err != nil || s != "re:c\n" {
		t.Fatalf("reply after heal %q, %v", s, err)
	}

	// Controller 0 cut from its clients: their calls get no answer.
	px.Cut(0, -1)
	send(cc, "lost")
	arrives(got0, "lost")
	if s, err := recv(rc, cc, 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("reply %q crossed the cut 0 -> clients (%v)", s, err)
	}
	if err := px.Cut(0, 0); err == nil {
		t.Fatal("a link from a node to itself accepted")
	}
	px.Heal()
	if s, err := recv(rc, cc, 5*time.Second); err != nil || s != "re:lost\n" {
		t.Fatalf("client reply after heal %q, %v", s, err)
	}
}
