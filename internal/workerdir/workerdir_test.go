package workerdir

import (
	"context"
	"errors"
	"sync"
	"testing"

	"go.uber.org/goleak"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// table is a workers table the test edits, standing in for the controller's
// (the directory reads nothing else of it).
type table struct {
	mu    sync.Mutex // guards rows, reads
	rows  map[string]string
	reads int
}

func (t *table) ListWorkers(context.Context, *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.reads++
	resp := &pb.ListWorkersResponse{}
	for id, addr := range t.rows {
		resp.Workers = append(resp.Workers, &pb.Worker{Id: id, GrpcAddr: addr})
	}
	return resp, nil
}

func (t *table) set(id, addr string) {
	t.mu.Lock()
	t.rows[id] = addr
	t.mu.Unlock()
}

func (t *table) readCount() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.reads
}

func TestDirectory(t *testing.T) {
	ctx := context.Background()
	tab := &table{rows: map[string]string{"w1": "127.0.0.1:1001"}}
	d := New(tab)
	defer d.Close()

	cc, err := d.Conn(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	if cc.Target() != "127.0.0.1:1001" {
		t.Fatalf("dialled %s", cc.Target())
	}
	again, err := d.Conn(ctx, "w1")
	if err != nil || again != cc {
		t.Fatalf("a known worker got a new connection (%v)", err)
	}
	if n := tab.readCount(); n != 1 {
		t.Fatalf("%d table reads for one unknown id", n)
	}

	if _, err := d.Conn(ctx, "w2"); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("unknown worker: %v", err)
	}
	tab.set("w2", "127.0.0.1:1002")
	if cc2, err := d.Conn(ctx, "w2"); err != nil || cc2.Target() != "127.0.0.1:1002" {
		t.Fatalf("a worker that registered since: %v", err)
	}

	// A worker restarted on another port is found after a refresh.
	tab.set("w1", "127.0.0.1:2001")
	if _, err := d.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if cc, err := d.Conn(ctx, "w1"); err != nil || cc.Target() != "127.0.0.1:2001" {
		t.Fatalf("after a refresh w1 is at %v (%v)", cc.Target(), err)
	}

	d.Close()
	d.Close()
	if _, err := d.Conn(ctx, "w1"); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}
