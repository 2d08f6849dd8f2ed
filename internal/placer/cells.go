package placer

import "math"

// BestFreeness returns the freeness (policy.Worker.Freeness) of the
// freest eligible worker of the view Take decides from — the table plus
// this gateway's placements it does not count — and false when no worker
// is eligible. A gateway in front of several cells keeps a replica per
// cell and compares the cells by it (issue 26; sim/cells.go): the cell
// whose freest worker is freest, where a lone gateway choosing over the
// union of the tables would place.
func (r *Replica) BestFreeness() (float64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	best, ok := math.Inf(-1), false
	for i := range r.views {
		if !r.views[i].Eligible {
			continue
		}
		v := r.views[i]
		if s, has := r.ownBy[v.ID]; has {
			v.PendingRequests += s.requests
			v.PendingPages += s.pages
		}
		if f := v.Freeness(); f > best {
			best, ok = f, true
		}
	}
	return best, ok
}
