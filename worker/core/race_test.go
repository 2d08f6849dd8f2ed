//go:build race

package core

// raceEnabled: the race detector slows the transformer's float loops about
// tenfold; the oracles run fewer transformer trials under it.
const raceEnabled = true
