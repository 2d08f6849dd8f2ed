package jepsen

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
)

// Net puts each controller in its own Linux network namespace, joined to a
// bridge in the harness's namespace by a veth pair, so partitions are real
// packet loss: a fault is a blackhole route, in a controller's namespace,
// to each address it must not reach (its packets there are discarded; the
// packets of an established TCP connection are retransmitted until the
// route is gone). Blackhole routes need no kernel module, unlike tc's drop
// action. Workers, the gateway and the harness stay in the root namespace,
// on the bridge's address.
type Net struct {
	prefix string // names: <prefix>br, <prefix>nN, <prefix>vN
	Bridge string // the root namespace's address on the bridge
	Hosts  []string

	mu   sync.Mutex
	cuts map[[2]int]bool // from -> to dropped
}

// NetAvailable says whether namespaces can be made here (root, iproute2).
func NetAvailable() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("network namespaces need iproute2 (ip): %w", err)
	}
	// Root is not always enough (a container without CAP_SYS_ADMIN): try.
	probe := fmt.Sprintf("ljprobe%d", os.Getpid())
	if err := run("ip", "netns", "add", probe); err != nil {
		return err
	}
	return run("ip", "netns", "del", probe)
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// NewNet makes n namespaces on subnet 10.<octet>.0.0/24. A leftover net of
// the same prefix (a run killed before its teardown) is removed first.
func NewNet(prefix string, octet, n int) (*Net, error) {
	if err := NetAvailable(); err != nil {
		return nil, err
	}
	nt := &Net{prefix: prefix, Bridge: fmt.Sprintf("10.%d.0.1", octet), cuts: map[[2]int]bool{}}
	for i := range n {
		nt.Hosts = append(nt.Hosts, fmt.Sprintf("10.%d.0.%d", octet, 11+i))
	}
	nt.Teardown()
	br := prefix + "br"
	steps := [][]string{
		{"ip", "link", "add", br, "type", "bridge"},
		{"ip", "addr", "add", nt.Bridge + "/24", "dev", br},
		{"ip", "link", "set", br, "up"},
	}
	for i := range n {
		ns, veth := nt.ns(i), fmt.Sprintf("%sv%d", prefix, i)
		steps = append(steps,
			[]string{"ip", "netns", "add", ns},
			[]string{"ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns},
			[]string{"ip", "link", "set", veth, "master", br, "up"},
			[]string{"ip", "netns", "exec", ns, "ip", "addr", "add", nt.Hosts[i] + "/24", "dev", "eth0"},
			[]string{"ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"},
			[]string{"ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"},
		)
	}
	for _, s := range steps {
		if err := run(s...); err != nil {
			nt.Teardown()
			return nil, err
		}
	}
	return nt, nil
}

func (nt *Net) ns(i int) string { return fmt.Sprintf("%sn%d", nt.prefix, i) }

// Wrap is the command prefix that runs a process in namespace i.
func (nt *Net) Wrap(i int) []string { return []string{"ip", "netns", "exec", nt.ns(i)} }

// Cut drops the packets node `from` sends to node `to` (to = -1: to the
// bridge, that is to workers, the gateway and the harness).
func (nt *Net) Cut(from, to int) error {
	nt.mu.Lock()
	defer nt.mu.Unlock()
	if nt.cuts[[2]int{from, to}] {
		return nil
	}
	dst := nt.Bridge
	if to >= 0 {
		dst = nt.Hosts[to]
	}
	if err := run("ip", "netns", "exec", nt.ns(from), "ip", "route", "add", "blackhole", dst+"/32"); err != nil {
		return err
	}
	nt.cuts[[2]int{from, to}] = true
	return nil
}

// Heal removes every cut.
func (nt *Net) Heal() error {
	nt.mu.Lock()
	defer nt.mu.Unlock()
	var first error
	for c := range nt.cuts {
		dst := nt.Bridge
		if c[1] >= 0 {
			dst = nt.Hosts[c[1]]
		}
		if err := run("ip", "netns", "exec", nt.ns(c[0]), "ip", "route", "del", "blackhole", dst+"/32"); err != nil && first == nil {
			first = err
		}
	}
	nt.cuts = map[[2]int]bool{}
	return first
}

// Cuts is how many directed links are cut now.
func (nt *Net) Cuts() int {
	nt.mu.Lock()
	defer nt.mu.Unlock()
	return len(nt.cuts)
}

// Teardown removes the namespaces and the bridge (errors ignored: some may
// never have been made).
func (nt *Net) Teardown() {
	for i := range nt.Hosts {
		_ = run("ip", "netns", "del", nt.ns(i))
	}
	_ = run("ip", "link", "del", nt.prefix+"br")
}
