package fsm

import (
	"fmt"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// BenchmarkApplyPlacement: one placement and its completion applied, per
// op, in entries of 64 placements and one Complete (as Place batches
// arrive), with the gateway naming the worker or Apply choosing it, over
// 16 and 1,024 workers. Naming the worker is a lookup (O(log n)); Apply's
// own choice scans every worker.
//
//	go test -run '^$' -bench ApplyPlacement -benchtime 200000x ./fsm/
func BenchmarkApplyPlacement(b *testing.B) {
	for _, workers := range []int{16, 1024} {
		for _, named := range []bool{true, false} {
			b.Run(fmt.Sprintf("workers=%d/named=%v", workers, named), func(b *testing.B) {
				f := New()
				var idx uint64
				apply := func(cmds []*pb.Command) {
					data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
					if err != nil {
						b.Fatal(err)
					}
					idx++
					f.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: data})
				}
				for w := 0; w < workers; w++ {
					apply([]*pb.Command{worker(fmt.Sprintf("w%04d", w), 1<<40)})
				}
				const per = 64
				entries := make([][]byte, 0, b.N/per+1)
				for i := 0; i < b.N; i += per {
					cmds := make([]*pb.Command, 0, per+1)
					ids := make([]string, 0, per)
					for j := i; j < min(i+per, b.N); j++ {
						id := fmt.Sprintf("r%d", j)
						c := dispatch(id, 100, 100)
						if named {
							c.GetDispatch().WorkerId, c.GetDispatch().WorkerIncarnation = fmt.Sprintf("w%04d", j%workers), 1
						}
						cmds = append(cmds, c)
						ids = append(ids, id)
					}
					cmds = append(cmds, complete(ids...))
					data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
					if err != nil {
						b.Fatal(err)
					}
					entries = append(entries, data)
				}
				b.ResetTimer()
				for _, data := range entries {
					idx++
					f.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: data})
				}
			})
		}
	}
}
