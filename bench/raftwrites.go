package bench

import (
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// raftWrites are one replica's counters of what it wrote to raft.db and,
// as leader, proposed (controller/raftstore.go, proposer.go), read from
// its /metrics.
type raftWrites struct {
	fsyncs   float64 // lumen_controller_raft_fsyncs_total, all ops
	entries  float64 // lumen_controller_raft_log_entries_total
	bytes    float64 // lumen_controller_raft_log_bytes_total
	commands map[string]float64
	cmdBytes map[string]float64
}

// parseRaftWrites reads the counters from a Prometheus text exposition.
func parseRaftWrites(text string) raftWrites {
	w := raftWrites{commands: map[string]float64{}, cmdBytes: map[string]float64{}}
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		if sp < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[sp+1:], 64)
		if err != nil {
			continue
		}
		name, label := line[:sp], ""
		if i := strings.IndexByte(name, '{'); i >= 0 {
			name, label = name[:i], name[i:]
			if j := strings.IndexByte(label, '"'); j >= 0 {
				label = label[j+1:]
				if k := strings.IndexByte(label, '"'); k >= 0 {
					label = label[:k]
				}
			}
		}
		switch name {
		case "lumen_controller_raft_fsyncs_total":
			w.fsyncs += v
		case "lumen_controller_raft_log_entries_total":
			w.entries = v
		case "lumen_controller_raft_log_bytes_total":
			w.bytes = v
		case "lumen_controller_proposed_commands_total":
			w.commands[label] = v
		case "lumen_controller_proposed_bytes_total":
			w.cmdBytes[label] = v
		}
	}
	return w
}

// readRaftWrites scrapes one replica; zeros when it cannot be read.
func readRaftWrites(httpAddr string) raftWrites {
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		return parseRaftWrites("")
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return parseRaftWrites("")
	}
	return parseRaftWrites(string(data))
}

// raftWriteFigures puts a phase's Raft write stream under its JSON keys
// (suffix _N for N callers; per command type _N_TYPE) and returns its
// table rows: from the leader's counters before and after (l0, l1) and a
// follower's (f0, f1), over elapsed. Every replica writes every entry;
// hashicorp/raft hands the store up to MaxAppendEntries entries a call,
// each call one bbolt commit, so fsyncs are at most the entries. A
// command's share of the fsyncs is counted pro rata: in a mixed stream
// every fsync carries commands of several types, so
// raft_fsyncs_per_s_N_TYPE is the fsyncs a second × TYPE's share of the
// commands.
func raftWriteFigures(out map[string]float64, callers int, l0, l1, f0, f1 raftWrites, elapsed time.Duration) []controllerRow {
	sec := elapsed.Seconds()
	if sec <= 0 || l1.fsyncs <= l0.fsyncs {
		return nil
	}
	key := func(k string) string { return fmt.Sprintf("%s_%d", k, callers) }
	fsyncs := (l1.fsyncs - l0.fsyncs) / sec
	entries := (l1.entries - l0.entries) / sec
	out[key("raft_fsyncs_per_s")] = fsyncs
	out[key("raft_fsyncs_per_s_follower")] = (f1.fsyncs - f0.fsyncs) / sec
	out[key("raft_log_entries_per_s")] = entries
	out[key("raft_log_bytes_per_s")] = (l1.bytes - l0.bytes) / sec
	out[key("raft_entries_per_fsync")] = entries / fsyncs
	var types []string
	var cmds float64
	for typ, v := range l1.commands {
		if d := v - l0.commands[typ]; d > 0 {
			types = append(types, typ)
			cmds += d
		}
	}
	sort.Strings(types)
	out[key("raft_commands_per_s")] = cmds / sec
	out[key("raft_commands_per_fsync")] = cmds / sec / fsyncs
	// fsyncs: bbolt commits (each two fdatasyncs); a type's fsyncs are
	// its share of the commands' (pro rata).
	rows := []controllerRow{{"  raft.db fsyncs/s: leader, follower",
		fmt.Sprintf("%.0f, %.0f; %.2f entries and %.1f commands each", fsyncs, out[key("raft_fsyncs_per_s_follower")],
			entries/fsyncs, cmds/sec/fsyncs), ""}}
	for _, typ := range types {
		c := (l1.commands[typ] - l0.commands[typ]) / sec
		b := (l1.cmdBytes[typ] - l0.cmdBytes[typ]) / sec
		out[key("raft_commands_per_s")+"_"+typ] = c
		out[key("raft_bytes_per_s")+"_"+typ] = b
		out[key("raft_fsyncs_per_s")+"_"+typ] = fsyncs * c / (cmds / sec)
		rows = append(rows, controllerRow{"    " + typ + ": commands, bytes, fsyncs/s",
			fmt.Sprintf("%.0f, %.0f, %.1f", c, b, out[key("raft_fsyncs_per_s")+"_"+typ]), ""})
	}
	return rows
}
