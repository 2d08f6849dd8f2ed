package fsm

import (
	"slices"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// clonePlacement is proto.Clone for a placement, field by field: a node's
// MarkFailed copies about a thousand placements (every copy the node held,
// every request it served), and proto.Clone's reflection was a sixth of
// it. TestClonePlacementIsProtoClone sets every field the descriptor has,
// so a field added to Placement and not here fails it.
func clonePlacement(p *pb.Placement) *pb.Placement {
	np := &pb.Placement{
		RequestId: p.RequestId, WorkerId: p.WorkerId, HolderId: p.HolderId, ReservedBytes: p.ReservedBytes,
		State: p.State, Epoch: p.Epoch, PromptTokens: p.PromptTokens, MaxTokens: p.MaxTokens,
		CreatedUnixNano: p.CreatedUnixNano, CreatedIndex: p.CreatedIndex, WorkerIncarnation: p.WorkerIncarnation,
		MigrationTarget: p.MigrationTarget, MigrationTargetIncarnation: p.MigrationTargetIncarnation,
		MigrationStartedUnixNano: p.MigrationStartedUnixNano, Priority: p.Priority,
	}
	if len(p.ReplicaHolders) > 0 {
		np.ReplicaHolders = slices.Clone(p.ReplicaHolders)
	}
	if u := p.ProtoReflect().GetUnknown(); len(u) > 0 {
		np.ProtoReflect().SetUnknown(slices.Clone(u))
	}
	return np
}
