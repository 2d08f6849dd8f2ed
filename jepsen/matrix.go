package jepsen

// MatrixRun is one run of the matrix: nemeses over a quorum of Controllers,
// with partitions made as Partitions says ("" follows the caller's choice).
type MatrixRun struct {
	Nemeses     []string
	Controllers int
	Partitions  string
}

// Matrix is `make jepsen` (`lumen jepsen -matrix`): every nemesis alone,
// then the combinations that matter.
var Matrix = []MatrixRun{
	{[]string{"kill-controller"}, 3, ""},
	{[]string{"kill-leader"}, 3, ""},
	{[]string{"kill-all-controllers"}, 3, ""},
	{[]string{"kill-worker"}, 3, ""},
	{[]string{"kill-holder"}, 3, ""},
	// Issue 24: every worker of a node killed at once (workers on nodes,
	// two a node), alone and beside the leader's death and a killed holder.
	{[]string{"node-kill"}, 3, ""},
	{[]string{"node-kill", "kill-leader", "kill-holder"}, 3, ""},
	{[]string{"gateway-kill"}, 3, ""},
	// Progressive recovery: drafters, their partners, hot swaps and the
	// leader killed while a restarted worker assists.
	{[]string{"assist-kill"}, 3, ""},
	// Live migration forced all along, its sources, destinations and the
	// leader killed mid-copy and at the commit.
	{[]string{"migrate"}, 3, ""},
	{[]string{"pause-leader"}, 3, ""},
	// Issue 21: the leader paused past the gateways' dispatch deadline
	// while both gateways place on the fast path; their Place streams to
	// it hang until their liveness moves them.
	{[]string{"pause-leader-long"}, 3, ""},
	{[]string{"pause-worker"}, 3, ""},
	{[]string{"partition-leader"}, 3, ""},
	{[]string{"partition-halves"}, 5, ""},
	{[]string{"partition-bridge"}, 5, ""},
	{[]string{"partition-one-way"}, 3, ""},
	{[]string{"membership"}, 3, ""},
	{[]string{"kill-leader", "kill-worker"}, 3, ""},
	{[]string{"partition-halves", "kill-holder"}, 3, ""},
	{[]string{"pause-leader", "pause-worker", "kill-holder"}, 3, ""},
	// A gateway's session must outlive faults of the quorum and the
	// holders; its placements must not outlive the gateway.
	{[]string{"gateway-kill", "kill-leader", "kill-holder"}, 3, ""},
	{[]string{"membership", "kill-controller", "partition-one-way"}, 5, ""},
	{[]string{"partition-leader", "kill-worker", "pause-worker", "kill-leader"}, 3, ""},
	// A paused partner or drafter (its stream hangs, it is marked failed
	// and rejoins) and a killed holder beside the assist.
	{[]string{"assist-kill", "pause-worker", "kill-holder"}, 3, ""},
	// Migrations beside paused workers (a stream to a paused destination
	// hangs), killed holders and gateways.
	{[]string{"migrate", "pause-worker", "kill-holder", "gateway-kill"}, 3, ""},
	// Issue 16: requests start before their placements commit. Their
	// worker killed while the commits stall, beside killed gateways and
	// workers.
	{[]string{"kill-uncommitted"}, 3, ""},
	{[]string{"kill-uncommitted", "gateway-kill", "kill-worker"}, 3, ""},
	// The fallback for machines without namespaces, also where they exist.
	{[]string{"partition-leader", "partition-halves", "partition-one-way"}, 3, "proxy"},
}
