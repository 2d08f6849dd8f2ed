// Package kvpage holds the size of a KV-cache page, the one unit the engine
// allocates, the checkpoint store keys and ships, and the controller's
// policies account in. It imports nothing, so the pure policy package and
// the engine can both share the one definition.
package kvpage

// Tokens is the number of token positions in one KV page.
const Tokens = 16

// Pages is the number of pages n tokens fill (the last one possibly in
// part).
func Pages(n int) int { return (n + Tokens - 1) / Tokens }
