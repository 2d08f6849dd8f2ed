package fsm

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestClonePlacementIsProtoClone: with every field of Placement set (from
// its descriptor, so a field added later is set too) and an unknown field,
// clonePlacement equals proto.Clone, shares no slice with the original,
// and an empty placement clones to an empty one.
func TestClonePlacementIsProtoClone(t *testing.T) {
	p := &pb.Placement{}
	m := p.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		var v protoreflect.Value
		switch fd.Kind() {
		case protoreflect.StringKind:
			v = protoreflect.ValueOfString("s" + string(fd.Name()))
		case protoreflect.EnumKind:
			v = protoreflect.ValueOfEnum(fd.Enum().Values().Get(fd.Enum().Values().Len() - 1).Number())
		case protoreflect.Uint64Kind:
			v = protoreflect.ValueOfUint64(uint64(1000 + i))
		case protoreflect.Uint32Kind:
			v = protoreflect.ValueOfUint32(uint32(100 + i))
		case protoreflect.Int64Kind:
			v = protoreflect.ValueOfInt64(int64(-1000 - i))
		case protoreflect.Int32Kind:
			v = protoreflect.ValueOfInt32(int32(-100 - i))
		default:
			t.Fatalf("field %s of kind %s: teach this test (and clonePlacement) about it", fd.Name(), fd.Kind())
		}
		if fd.IsList() {
			l := m.Mutable(fd).List()
			l.Append(v)
			l.Append(v)
			continue
		}
		m.Set(fd, v)
	}
	m.SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 999, protowire.VarintType), 7))
	got := clonePlacement(p)
	if !proto.Equal(got, proto.Clone(p)) {
		t.Fatalf("clonePlacement\n %v\nproto.Clone\n %v", got, proto.Clone(p))
	}
	for i := 0; i < fields.Len(); i++ {
		if fd := fields.Get(i); !got.ProtoReflect().Has(fd) {
			t.Fatalf("field %s not copied", fd.Name())
		}
	}
	got.ReplicaHolders[0] = "changed"
	if p.ReplicaHolders[0] == "changed" {
		t.Fatal("the clone shares replica_holders with the original")
	}
	if e := clonePlacement(&pb.Placement{}); !proto.Equal(e, &pb.Placement{}) || e.ReplicaHolders != nil {
		t.Fatalf("empty: %v", e)
	}
}
