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
	// The greatest key of the share trees (tree.go): the freest eligible
	// worker of cur, what a scan of viewsLocked() finds.
	r.ensureTree()
	best := math.Inf(-1)
	for h := range r.trees {
		if f, _ := r.trees[h].max(); f > best {
			best = f
		}
	}
	return best, !math.IsInf(best, -1)
}
