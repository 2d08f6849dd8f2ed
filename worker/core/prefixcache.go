package core

import (
	"slices"

	"github.com/lumen-project/lumen/worker/engine"
)

// Automatic prefix caching (issue 25), on when Config.PrefixCache is set.
//
// A full KV page is named by its prefix hash (PageHashes: the hash of every
// token up to its end, the checkpoint tag), which is vLLM's block hash: two
// requests whose histories agree through a page's end have the same KV in
// it. Once a request's page fills (Done) it enters the cache under its hash
// and the request references it; a request admitted later whose history
// starts with cached pages references them too and prefills only the rest
// (a hit), at least one token of it so that the next token is computed. A
// page is shared by reference count: when the last request holding it ends,
// is preempted, moves or is cancelled, the page stays in the cache,
// unreferenced, and counts as free; a step that needs more pages than the
// engine has free evicts unreferenced pages, least recently released
// first. A request releases its pages from its tail to its head, so of one
// request's pages the tail goes first (vLLM's KVCacheManager frees a
// request's blocks in reverse order into its free-block queue for the same
// reason: a tail is the least likely to be shared).
//
// A page filled by two requests at once (both prefilled the same prefix
// before either's page entered the cache) is kept once: the second
// request's copy is freed and it references the cached one. Preemption
// drops a request's references, not the pages: a preempted request usually
// hits its own pages when it is admitted again. Checkpointing is by request
// (a shared page is shipped once per request holding it, to that
// request's holder), and a restore takes the pages the cache holds from the
// cache and imports only the holder's pages past them (Restore.Cached).
//
// The cache's accounting: CachedPages is the pages requests hold (a shared
// page once), EvictablePages the unreferenced ones; what the engine has
// free excludes both (the simulator passes KVPages − CachedPages −
// EvictablePages to Next), and Next counts the evictable pages as free,
// evicting at the end of the step's build as many as the step needs past
// the free ones. Output.KVStored and KVRemoved are the hashes of the pages
// that entered and left the cache (the KV events a gateway's index of each
// worker's cache is built from).
//
// The simulator turns it on (a page is an account there), and so does the
// worker daemon with -prefix-cache on: the engines share full pages by
// reference (engine.PageSharer), and the daemon keeps each cached page by
// a holder sequence of that one page, made from KVStoredAt, adopted by a
// request that filled a copy of it (Adopts), shared into a hit's sequence
// by Shares, released on KVRemoved (worker/prefixcache.go;
// docs/architecture.md).

// cpage is one cached page.
type cpage struct {
	hash       uint64
	refs       int
	prev, next *cpage // the LRU list of unreferenced pages, when refs == 0
}

// prefixCache is the pages by hash, and the unreferenced ones in the order
// they were released (head: evicted first).
type prefixCache struct {
	pages      map[uint64]*cpage
	head, tail *cpage
	idle       int // unreferenced pages (the list's length)
}

func newPrefixCache() *prefixCache { return &prefixCache{pages: map[uint64]*cpage{}} }

func (pc *prefixCache) unlink(p *cpage) {
	if p.prev != nil {
		p.prev.next = p.next
	} else {
		pc.head = p.next
	}
	if p.next != nil {
		p.next.prev = p.prev
	} else {
		pc.tail = p.prev
	}
	p.prev, p.next = nil, nil
	pc.idle--
}

func (pc *prefixCache) push(p *cpage) {
	p.prev, p.next = pc.tail, nil
	if pc.tail != nil {
		pc.tail.next = p
	} else {
		pc.head = p
	}
	pc.tail = p
	pc.idle++
}

// ref takes a reference to p, taking it off the LRU list if it was
// unreferenced; it reports whether it was.
func (pc *prefixCache) ref(p *cpage) bool {
	p.refs++
	if p.refs == 1 {
		pc.unlink(p)
		return true
	}
	return false
}

// EvictablePages is the cached pages no request references: free for the
// engine's purposes, evicted when a step needs them (0 with the cache off).
func (c *Core) EvictablePages() int {
	if c.pc == nil {
		return 0
	}
	return c.pc.idle
}

// SharedPages is the cached pages requests reference (each once).
func (c *Core) sharedPages() int {
	if c.pc == nil {
		return 0
	}
	return len(c.pc.pages) - c.pc.idle
}

// lookupHit returns how many of r's first pages the cache holds (at least
// one token left to compute), the hashes of r's history (cached on r), and
// how many of the hit pages are unreferenced now. 0 with the cache off or
// for a request that holds a cache already.
func (c *Core) lookupHit(r *Request) (hit, idle int) {
	if c.pc == nil || r.fed > 0 || len(r.History) < 2 || r.PromptLogprobs {
		// A request scoring its prompt (echo) prefills all of it.
		return 0, 0
	}
	r.lookup = PageHashes(r.History[:len(r.History)-1], r.lookup)
	for _, h := range r.lookup {
		p := c.pc.pages[h]
		if p == nil {
			break
		}
		hit++
		if p.refs == 0 {
			idle++
		}
	}
	return hit, idle
}

// takeHit makes r, newly admitted with an empty cache, reference its first
// hit pages: they count as in its cache.
func (c *Core) takeHit(r *Request, hit int) {
	c.out.CacheQueryTokens += len(r.History)
	if hit == 0 {
		return
	}
	for _, h := range r.lookup[:hit] {
		c.pc.ref(c.pc.pages[h])
	}
	r.fed = hit * engine.PageTokens
	r.hashes = slices.Clone(r.lookup[:hit])
	c.out.Shares = append(c.out.Shares, Share{Seq: r.seq, Hashes: r.hashes[:hit:hit]})
	r.cached = hit
	r.restoreTried = true
	c.out.CacheHitTokens += r.fed
	if r.resume {
		c.out.RecomputedTokens += len(r.History) - r.fed
		c.out.ResumeCachedPages += hit
	}
}

// register puts r's full pages that are not yet in the cache into it (or,
// when another request's copy is there, references that one).
func (c *Core) register(r *Request) {
	if c.pc == nil || r.held || r.fed/engine.PageTokens <= r.cached {
		return
	}
	r.hashes = PageHashes(r.History[:r.fed], r.hashes)
	for ; r.cached < len(r.hashes); r.cached++ {
		h := r.hashes[r.cached]
		if p := c.pc.pages[h]; p != nil {
			// Another request's copy entered the cache first: r gives
			// its own up for that one (Adopts), so the page counts once.
			c.pc.ref(p)
			c.out.Adopts = append(c.out.Adopts, Adopt{Seq: r.seq, Page: r.cached, Hash: h})
			continue
		}
		c.pc.pages[h] = &cpage{hash: h, refs: 1}
		c.out.KVStored = append(c.out.KVStored, h)
		c.out.KVStoredAt = append(c.out.KVStoredAt, PageAt{Seq: r.seq, Page: r.cached})
	}
}

// unref drops r's references to cached pages, from its tail to its head,
// after registering its full pages (a finished or preempted request's
// history is what the next turn or its own re-admission starts with). It
// returns the pages freed: those r held alone outside the cache, and the
// cached ones no request references any more (both now count as free).
// With the cache off it returns PagesFor(r.fed).
func (c *Core) unref(r *Request) (private, idle int) {
	if c.pc == nil {
		return PagesFor(r.fed), 0
	}
	c.register(r)
	private = PagesFor(r.fed) - r.cached
	for i := r.cached - 1; i >= 0; i-- {
		p := c.pc.pages[r.hashes[i]]
		if p.refs--; p.refs == 0 {
			c.pc.push(p)
			idle++
		}
	}
	r.cached = 0
	c.released += private
	return private, idle
}

// freed is unref's pages in all.
func (c *Core) freed(r *Request) int {
	p, i := c.unref(r)
	return p + i
}

// evictFor evicts unreferenced pages, least recently released first, so
// that a step needing demand new pages fits in the free ones.
func (c *Core) evictFor(demand, free int) {
	for n := demand - free; n > 0 && c.pc.head != nil; n-- {
		p := c.pc.head
		c.pc.unlink(p)
		delete(c.pc.pages, p.hash)
		c.out.KVRemoved = append(c.out.KVRemoved, p.hash)
	}
}

// stepDemand is the new pages st needs: its chunks past each request's
// cache, and the pages its restores import.
func stepDemand(st Step) int {
	n := 0
	for i, ch := range st.Batch {
		r := st.Reqs[i]
		n += PagesFor(r.fed+len(ch.Tokens)) - PagesFor(r.fed)
	}
	for _, rs := range st.Restores {
		n += len(rs.Pages)
	}
	return n
}

// ResetCache drops every unreferenced cached page (a cache reset), each
// reported in KVRemoved. Pages requests reference stay.
func (c *Core) ResetCache() {
	if c.pc == nil {
		return
	}
	c.evictFor(c.pc.idle, 0)
}
