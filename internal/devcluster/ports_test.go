package devcluster

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/healthz"
)

// The kernel may offer a port it just released again: FreePort must not
// hand out a reserved port (lumen dev's -http, picked by its caller and
// released) nor one it handed out before. The listener is made to offer
// the same ports again and again, as an unlucky kernel would.
func TestFreePortSkipsReservedAndHandedOut(t *testing.T) {
	var offered []int
	for range 3 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		offered = append(offered, l.Addr().(*net.TCPAddr).Port)
		l.Close()
	}
	i := 0
	listenTCP = func(network, _ string) (net.Listener, error) {
		p := offered[min(i, len(offered)-1)]
		i++
		return net.Listen(network, net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	}
	defer func() { listenTCP = net.Listen }()

	Reserve(net.JoinHostPort("127.0.0.1", strconv.Itoa(offered[0])))
	p, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	if p != offered[1] {
		t.Fatalf("FreePort gave %d with %d reserved; want the next port offered, %d", p, offered[0], offered[1])
	}
	i = 0
	p, err = FreePort()
	if err != nil {
		t.Fatal(err)
	}
	if p != offered[2] {
		t.Fatalf("FreePort gave %d again (handed out before, or reserved); want %d", p, offered[2])
	}
	i = 0
	if p, err := FreePort(); err == nil {
		t.Fatalf("FreePort gave %d, when every port offered was reserved or handed out", p)
	}
}

// Another process answering on the port does not make a child "listening":
// only an answer stamped with the child's pid counts (a gateway whose
// -http port a worker's metrics server holds would otherwise be taken for
// started, and clients sent to the worker).
func TestPollHealthzWantsTheChildsAnswer(t *testing.T) {
	// The child "exits" (it could not bind) once the other process has
	// answered twice.
	exited := make(chan struct{})
	var hits atomic.Int32
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set(healthz.PidHeader, "1")
		w.Write([]byte("ok\n"))
		if hits.Add(1) == 2 {
			close(exited)
		}
	}))
	defer other.Close()
	addr := other.Listener.Addr().String()
	if pollHealthz(context.Background(), addr, 12345, exited) {
		t.Fatal("pollHealthz took another process's answer for the child's")
	}
	own := httptest.NewServer(http.HandlerFunc(healthz.OK))
	defer own.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !pollHealthz(ctx, own.Listener.Addr().String(), os.Getpid(), make(chan struct{})) {
		t.Fatal("pollHealthz missed the child's own answer")
	}
}
