package jepsen

import (
	"encoding/json"
	"math"
	"os"
	"sync"
	"time"
)

// Kind is a placement operation.
type Kind string

// The placement workload's operations.
const (
	Dispatch  Kind = "dispatch"
	Complete  Kind = "complete"
	GetLin    Kind = "get"         // linearizable GetPlacement
	GetStale  Kind = "get-stale"   // stale GetPlacement
	Unknown        = math.MaxInt64 // the Return of an operation whose outcome is unknown
	notReturn      = -1
)

// Op is one operation of a history. Call and Return are nanoseconds since
// the start of the run on one monotonic clock; an operation whose outcome is
// unknown (timeout, connection lost) has Return = Unknown and Indeterminate
// set, as in etcd's robustness tests: it may have happened at any time after
// its call, or never.
type Op struct {
	Client        int    `json:"client"`
	Kind          Kind   `json:"kind"`
	ID            string `json:"id"`
	Call          int64  `json:"call"`
	Return        int64  `json:"return"`
	Indeterminate bool   `json:"indeterminate,omitempty"`
	Err           string `json:"err,omitempty"`
	// Results. Found: the placement exists (get), or the request was
	// completed by this call (complete).
	Found   bool   `json:"found,omitempty"`
	Worker  string `json:"worker,omitempty"`
	Inc     uint64 `json:"incarnation,omitempty"`
	Epoch   uint64 `json:"epoch,omitempty"`
	Created uint64 `json:"created_index,omitempty"`
	Index   uint64 `json:"index,omitempty"` // the log index the reply names
	// Via is the path the operation took: "" the unary calls (Dispatch,
	// Complete, GetPlacement), ViaPlace a gateway's Place stream (Dispatch
	// and Complete), ViaBatch a GetPlacements batch (a read of several ids
	// at once: each id's read is an operation of its own, called when the
	// batch was sent and returned when its answer came).
	Via string `json:"via,omitempty"`
	// Chose and ChoseInc are the worker incarnation a Dispatch named (the
	// gateway's choice, from a replica of the load table); Dead, that the
	// client knew that incarnation gone when it named it (the controller
	// must refuse it); Refusal, the ErrorInfo reason of a refusal.
	Chose    string `json:"chose,omitempty"`
	ChoseInc uint64 `json:"chose_incarnation,omitempty"`
	Dead     bool   `json:"dead,omitempty"`
	Refusal  string `json:"refusal,omitempty"`
	// Answered is the request id of the placement a Dispatch's answer
	// carried, when it is not the Dispatch's own.
	Answered string `json:"answered,omitempty"`
}

// The paths an operation may take (Op.Via).
const (
	ViaPlace = "place"
	ViaBatch = "batch"
)

// History collects operations from concurrent clients.
type History struct {
	start time.Time
	mu    sync.Mutex
	ops   []Op
}

// NewHistory starts the clock.
func NewHistory() *History { return &History{start: time.Now()} }

// Now is the history's clock.
func (h *History) Now() int64 { return int64(time.Since(h.start)) }

// Add records a finished operation.
func (h *History) Add(op Op) {
	h.mu.Lock()
	h.ops = append(h.ops, op)
	h.mu.Unlock()
}

// Ops returns a copy of the operations so far.
func (h *History) Ops() []Op {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Op(nil), h.ops...)
}

// WriteJSONL writes one operation a line.
func WriteJSONL(path string, ops []Op) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	for _, op := range ops {
		if err := enc.Encode(op); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}
