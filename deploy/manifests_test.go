package deploy

import (
	"fmt"
	"net"
	"os/exec"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// addrFlag is a flag that binds a port.
type addrFlag struct {
	name string
	// advertised: the process tells others this address (Serf tags, the
	// worker table), so it must bind the pod's IP, not 0.0.0.0.
	advertised bool
	udp        bool // Serf listens on TCP and UDP
}

// The address flags of each server command, and the one serving /metrics,
// /healthz and /readyz.
var (
	addrFlags = map[string][]addrFlag{
		"controller": {{"grpc-addr", true, false}, {"raft-addr", true, false}, {"serf-addr", true, true}, {"http-addr", false, false}},
		"worker":     {{"grpc-addr", true, false}, {"serf-addr", true, true}, {"http-addr", false, false}},
		"gateway":    {{"http", false, false}},
	}
	httpFlag = map[string]string{"controller": "http-addr", "worker": "http-addr", "gateway": "http"}
	// grpcFlag: the commands that serve gRPC (with the health service).
	grpcFlag = map[string]string{"controller": "grpc-addr", "worker": "grpc-addr"}
)

// podIP stands for status.podIP when $(POD_IP) is expanded.
const podIP = "10.244.1.7"

// proc is one container running a lumen server command.
type proc struct {
	ov  *objects
	w   workload
	c   *corev1.Container
	sub string
	// raw and flags: -name=value as written and with $(VAR) expanded.
	raw, flags map[string]string
	args       []string // the expanded command line after "lumen"
	env        map[string]string
}

func (p *proc) String() string {
	return fmt.Sprintf("%s: %s %s, container %s", p.ov.dir, p.w.kind, p.w.name, p.c.Name)
}

var flagForm = regexp.MustCompile(`^-([a-z][a-z0-9-]*)=(.*)$`)

// procs lists every lumen container of every rendered overlay; what is
// wrong with their command lines TestContainerFlags reports.
func procs(t *testing.T) []*proc {
	t.Helper()
	ps, _ := procsAndProblems(t)
	return ps
}

// procsAndProblems reads the containers' command lines. Flags must be
// written -name=value (one argument each), so that they read one way.
func procsAndProblems(t *testing.T) ([]*proc, []string) {
	t.Helper()
	var ps []*proc
	var problems []string
	errorf := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	for _, o := range renderAll(t) {
		for _, w := range o.workloads() {
			for i := range w.pod.Containers {
				c := &w.pod.Containers[i]
				if len(c.Command) != 1 || c.Command[0] != "lumen" || len(c.Args) == 0 {
					errorf("%s: %s %s, container %s: command %q args %q: want command [lumen] and the subcommand first in args",
						o.dir, w.kind, w.name, c.Name, c.Command, c.Args)
					continue
				}
				p := &proc{ov: o, w: w, c: c, sub: c.Args[0], raw: map[string]string{}, flags: map[string]string{}}
				if addrFlags[p.sub] == nil {
					errorf("%s: runs lumen %s, not a server command", p, p.sub)
					continue
				}
				p.env = containerEnv(w, c)
				p.args = []string{p.sub}
				for _, a := range c.Args[1:] {
					m := flagForm.FindStringSubmatch(a)
					if m == nil {
						errorf("%s: argument %q: write flags as -name=value", p, a)
						continue
					}
					if _, dup := p.raw[m[1]]; dup {
						errorf("%s: -%s given twice (the last wins, silently)", p, m[1])
					}
					v, err := expand(m[2], p.env)
					if err != nil {
						errorf("%s: -%s: %v", p, m[1], err)
					}
					p.raw[m[1]], p.flags[m[1]] = m[2], v
					p.args = append(p.args, "-"+m[1]+"="+v)
				}
				ps = append(ps, p)
			}
		}
	}
	if len(ps) == 0 {
		t.Fatal("no lumen containers rendered")
	}
	return ps, problems
}

// containerEnv is the container's environment as the kubelet would set it
// in w's first pod: the downward API's fields stand for sample values.
func containerEnv(w workload, c *corev1.Container) map[string]string {
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			v, _ := expand(e.Value, env)
			env[e.Name] = v
		case e.ValueFrom.FieldRef != nil:
			switch e.ValueFrom.FieldRef.FieldPath {
			case "metadata.name":
				env[e.Name] = w.podName()
			case "status.podIP":
				env[e.Name] = podIP
			default:
				env[e.Name] = "field:" + e.ValueFrom.FieldRef.FieldPath
			}
		default:
			env[e.Name] = "secret-or-config-value"
		}
	}
	return env
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand replaces $(VAR) as the kubelet does in command and args; a
// reference to a variable the container does not define stays as written
// there, which here is an error.
func expand(s string, env map[string]string) (string, error) {
	var err error
	out := varRef.ReplaceAllStringFunc(s, func(ref string) string {
		name := ref[2 : len(ref)-1]
		v, ok := env[name]
		if !ok {
			err = fmt.Errorf("$(%s) is not in the container's env: the kubelet would pass it literally", name)
			return ref
		}
		return v
	})
	return out, err
}

func port(addr string) (int, error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(p)
}

// flagCheck caches `lumen ... -h` per command line: the same containers
// appear in several overlays.
var flagCheck sync.Map

func checkFlags(args []string) error {
	key := strings.Join(args, "\x00")
	if v, ok := flagCheck.Load(key); ok {
		if v == nil {
			return nil
		}
		return v.(error)
	}
	err := acceptsFlags(args)
	if err == nil {
		flagCheck.Store(key, nil)
	} else {
		flagCheck.Store(key, err)
	}
	return err
}

// TestContainerFlags: the binary accepts every container's command line.
func TestContainerFlags(t *testing.T) {
	ps, problems := procsAndProblems(t)
	for _, pr := range problems {
		t.Error(pr)
	}
	for _, p := range ps {
		if err := checkFlags(p.args); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
}

// TestContainerPorts: each address flag is set, binds the pod's IP when
// other processes are told it, and is declared as a container port with
// its protocols; no port is declared that no flag binds.
func TestContainerPorts(t *testing.T) {
	for _, p := range procs(t) {
		declared := map[string]bool{} // "7200/UDP"
		for _, cp := range p.c.Ports {
			proto := cp.Protocol
			if proto == "" {
				proto = corev1.ProtocolTCP
			}
			declared[fmt.Sprintf("%d/%s", cp.ContainerPort, proto)] = true
		}
		bound := map[string]bool{}
		for _, f := range addrFlags[p.sub] {
			raw, ok := p.raw[f.name]
			if !ok {
				t.Errorf("%s: -%s is not set (its default binds loopback, out of other pods' reach)", p, f.name)
				continue
			}
			host, _, err := net.SplitHostPort(raw)
			if err != nil {
				t.Errorf("%s: -%s=%s: %v", p, f.name, raw, err)
				continue
			}
			if f.advertised && host != "$(POD_IP)" {
				t.Errorf("%s: -%s=%s: the process advertises what it binds; bind $(POD_IP)", p, f.name, raw)
			}
			if !f.advertised && host != "0.0.0.0" && host != "$(POD_IP)" {
				t.Errorf("%s: -%s=%s: bind 0.0.0.0 or $(POD_IP) to be reached from outside the pod", p, f.name, raw)
			}
			n, err := port(p.flags[f.name])
			if err != nil || n == 0 {
				t.Errorf("%s: -%s=%s: no fixed port", p, f.name, raw)
				continue
			}
			protos := []string{"TCP"}
			if f.udp {
				protos = append(protos, "UDP")
			}
			for _, proto := range protos {
				k := fmt.Sprintf("%d/%s", n, proto)
				bound[k] = true
				if !declared[k] {
					t.Errorf("%s: -%s binds %s but no container port declares it", p, f.name, k)
				}
			}
		}
		for k := range declared {
			if !bound[k] {
				t.Errorf("%s: container port %s is bound by no flag", p, k)
			}
		}
	}
}

// namedPort resolves a probe's or a Service's target port on a container.
func namedPort(c *corev1.Container, ip intstr.IntOrString, proto corev1.Protocol) (int, bool) {
	if proto == "" {
		proto = corev1.ProtocolTCP
	}
	for _, cp := range c.Ports {
		cproto := cp.Protocol
		if cproto == "" {
			cproto = corev1.ProtocolTCP
		}
		if cproto != proto {
			continue
		}
		if (ip.Type == intstr.String && cp.Name == ip.StrVal) || (ip.Type == intstr.Int && cp.ContainerPort == ip.IntVal) {
			return int(cp.ContainerPort), true
		}
	}
	return 0, false
}

// probeTarget is what a probe asks of which command: an HTTP path, or gRPC
// health.
type probeTarget struct {
	sub, path string // path "grpc" for a gRPC health probe
	service   string // the gRPC health service name
}

// TestProbes: HTTP probes hit the port of the flag that serves /healthz and
// /readyz, with HTTPS when that server has a certificate, at those paths;
// gRPC probes hit the gRPC port, where TLS is off (the kubelet's gRPC probe
// speaks plaintext). TestProbesServed asks running processes for each.
func TestProbes(t *testing.T) {
	for _, p := range procs(t) {
		probes := map[string]*corev1.Probe{"startup": p.c.StartupProbe, "liveness": p.c.LivenessProbe, "readiness": p.c.ReadinessProbe}
		if p.c.LivenessProbe == nil || p.c.ReadinessProbe == nil {
			t.Errorf("%s: a liveness and a readiness probe are required", p)
		}
		for kind, pr := range probes {
			if pr == nil {
				continue
			}
			switch {
			case pr.HTTPGet != nil:
				want, _ := port(p.flags[httpFlag[p.sub]])
				if got, ok := namedPort(p.c, pr.HTTPGet.Port, ""); !ok || got != want {
					t.Errorf("%s: %s probe on port %s (%d), but /healthz and /readyz are served on -%s's %d", p, kind, pr.HTTPGet.Port.String(), got, httpFlag[p.sub], want)
				}
				if pr.HTTPGet.Path != "/healthz" && pr.HTTPGet.Path != "/readyz" {
					t.Errorf("%s: %s probe path %q: lumen serves /healthz and /readyz", p, kind, pr.HTTPGet.Path)
				}
				tls := p.sub == "gateway" && p.flags["tls-cert"] != ""
				if scheme := pr.HTTPGet.Scheme; (scheme == corev1.URISchemeHTTPS) != tls {
					t.Errorf("%s: %s probe scheme %q, but the server's TLS is %v", p, kind, scheme, tls)
				}
				if kind == "readiness" && pr.HTTPGet.Path != "/readyz" {
					t.Errorf("%s: the readiness probe should ask /readyz", p)
				}
				if kind == "liveness" && pr.HTTPGet.Path != "/healthz" {
					t.Errorf("%s: the liveness probe should ask /healthz (/readyz fails without a leader: every replica would be restarted)", p)
				}
			case pr.GRPC != nil:
				f, ok := grpcFlag[p.sub]
				if !ok {
					t.Errorf("%s: %s probe is gRPC, but lumen %s serves no gRPC", p, kind, p.sub)
					continue
				}
				if want, _ := port(p.flags[f]); int(pr.GRPC.Port) != want {
					t.Errorf("%s: %s gRPC probe on port %d, but -%s listens on %d", p, kind, pr.GRPC.Port, f, want)
				}
				if p.flags["tls-cert"] != "" {
					t.Errorf("%s: %s gRPC probe against a server with TLS: the kubelet's gRPC probe does not speak TLS", p, kind)
				}
			default:
				t.Errorf("%s: %s probe is neither httpGet nor grpc", p, kind)
			}
		}
	}
}

// TestPrometheusAnnotations: the pod annotations the scrape configuration
// reads name the metrics port, path and scheme.
func TestPrometheusAnnotations(t *testing.T) {
	for _, p := range procs(t) {
		var ann map[string]string
		if p.w.sts != nil {
			ann = p.w.sts.Spec.Template.Annotations
		} else {
			for _, d := range p.ov.deployments {
				if d.Name == p.w.name {
					ann = d.Spec.Template.Annotations
				}
			}
		}
		want, _ := port(p.flags[httpFlag[p.sub]])
		if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != strconv.Itoa(want) || ann["prometheus.io/path"] != "/metrics" {
			t.Errorf("%s: annotations %v: want prometheus.io/scrape true, port %d, path /metrics", p, ann, want)
		}
		tls := p.sub == "gateway" && p.flags["tls-cert"] != ""
		if (ann["prometheus.io/scheme"] == "https") != tls {
			t.Errorf("%s: prometheus.io/scheme %q, but the server's TLS is %v", p, ann["prometheus.io/scheme"], tls)
		}
	}
}

// controllers finds the overlay's controller StatefulSet and its container.
func controllers(t *testing.T, ps []*proc, o *objects) *proc {
	t.Helper()
	var found *proc
	for _, p := range ps {
		if p.ov == o && p.sub == "controller" {
			if found != nil {
				t.Fatalf("%s: two controller workloads (%s, %s)", o.dir, found.w.name, p.w.name)
			}
			found = p
		}
	}
	if found == nil {
		t.Fatalf("%s: no controllers", o.dir)
	}
	if found.w.kind != "StatefulSet" {
		t.Fatalf("%s: controllers run as a %s; they need a StatefulSet (stable names and a volume each)", o.dir, found.w.kind)
	}
	return found
}

// dnsNames lists the pods' names under the headless Service, with port.
func (p *proc) dnsNames(port int) []string {
	var out []string
	for i := 0; i < p.w.replicas; i++ {
		out = append(out, fmt.Sprintf("%s-%d.%s:%d", p.w.name, i, p.w.service, port))
	}
	return out
}

func sameSet(a, b []string) bool {
	a, b = append([]string(nil), a...), append([]string(nil), b...)
	sort.Strings(a)
	sort.Strings(b)
	return strings.Join(a, ",") == strings.Join(b, ",")
}

// TestControllerQuorum: the StatefulSet, its headless Service and its
// PodDisruptionBudget fit together, and the controllers find each other by
// the names the Service gives their pods.
func TestControllerQuorum(t *testing.T) {
	ps := procs(t)
	for _, o := range renderAll(t) {
		c := controllers(t, ps, o)
		sts := c.w.sts
		if c.w.replicas != 3 && c.w.replicas != 5 {
			t.Errorf("%s: %d controller replicas: a quorum is 3 or 5", o.dir, c.w.replicas)
		}
		if c.flags["bootstrap-expect"] != strconv.Itoa(c.w.replicas) {
			t.Errorf("%s: -bootstrap-expect=%s with %d replicas", o.dir, c.flags["bootstrap-expect"], c.w.replicas)
		}
		if sts.Spec.PodManagementPolicy != "Parallel" {
			t.Errorf("%s: podManagementPolicy %q: with OrderedReady the second replica waits for the first to be ready, which needs a leader, which needs the second", o.dir, sts.Spec.PodManagementPolicy)
		}
		var svc *corev1.Service
		for _, s := range o.services {
			if s.Name == c.w.service {
				svc = s
			}
		}
		switch {
		case svc == nil:
			t.Errorf("%s: serviceName %q names no Service", o.dir, c.w.service)
		case svc.Spec.ClusterIP != corev1.ClusterIPNone:
			t.Errorf("%s: Service %s is not headless: the pods get no DNS names", o.dir, svc.Name)
		case !svc.Spec.PublishNotReadyAddresses:
			t.Errorf("%s: Service %s must publish not-ready addresses: a replica is ready only once the quorum it forms through those names has a leader", o.dir, svc.Name)
		case !selects(svc.Spec.Selector, c.w.labels):
			t.Errorf("%s: Service %s selects %v, not the controller pods (%v)", o.dir, svc.Name, svc.Spec.Selector, c.w.labels)
		}
		if c.raw["id"] != "$(POD_NAME)" {
			t.Errorf("%s: -id=%s: the replica ids must be the pod names (-raft-peer-addrs and the DNS names use them)", o.dir, c.raw["id"])
		}
		serf, _ := port(c.flags["serf-addr"])
		if got := strings.Split(c.flags["join"], ","); !sameSet(got, c.dnsNames(serf)) {
			t.Errorf("%s: -join=%s, want every replica's DNS name and Serf port: %s", o.dir, c.flags["join"], strings.Join(c.dnsNames(serf), ","))
		}
		raft, _ := port(c.flags["raft-addr"])
		var wantPeers []string
		for i, n := range c.dnsNames(raft) {
			wantPeers = append(wantPeers, fmt.Sprintf("%s-%d=%s", c.w.name, i, n))
		}
		if got := strings.Split(c.flags["raft-peer-addrs"], ","); !sameSet(got, wantPeers) {
			t.Errorf("%s: -raft-peer-addrs=%s, want %s (Raft keeps the pod IP a replica first had; a restarted pod has another)", o.dir, c.flags["raft-peer-addrs"], strings.Join(wantPeers, ","))
		}
		// raft.db and the snapshots live on a volume of the replica's own.
		dataDir := c.flags["data-dir"]
		onClaim := false
		for _, m := range c.c.VolumeMounts {
			if dataDir == m.MountPath || strings.HasPrefix(dataDir, m.MountPath+"/") {
				for _, vct := range sts.Spec.VolumeClaimTemplates {
					if vct.Name == m.Name {
						onClaim = true
					}
				}
			}
		}
		if !onClaim {
			t.Errorf("%s: -data-dir=%s is not on a volumeClaimTemplate's volume: raft.db would not outlive the pod", o.dir, dataDir)
		}
		var pdbOK bool
		for _, pdb := range o.pdbs {
			if pdb.Spec.Selector != nil && selects(pdb.Spec.Selector.MatchLabels, c.w.labels) {
				pdbOK = pdb.Spec.MaxUnavailable != nil && pdb.Spec.MaxUnavailable.IntValue() == 1
			}
		}
		if !pdbOK {
			t.Errorf("%s: no PodDisruptionBudget with maxUnavailable 1 over the controllers", o.dir)
		}
	}
}

// TestClientsFindControllers: workers and gateways dial every controller
// replica's gRPC address, and workers join the controllers' Serf, by the
// replicas' DNS names.
func TestClientsFindControllers(t *testing.T) {
	ps := procs(t)
	for _, o := range renderAll(t) {
		c := controllers(t, ps, o)
		grpcPort, _ := port(c.flags["grpc-addr"])
		serfPort, _ := port(c.flags["serf-addr"])
		clients := 0
		for _, p := range ps {
			if p.ov != o || p.sub == "controller" {
				continue
			}
			clients++
			if got := strings.Split(p.flags["controllers"], ","); !sameSet(got, c.dnsNames(grpcPort)) {
				t.Errorf("%s: -controllers=%s, want %s", p, p.flags["controllers"], strings.Join(c.dnsNames(grpcPort), ","))
			}
			if p.sub == "worker" {
				if got := strings.Split(p.flags["join"], ","); !sameSet(got, c.dnsNames(serfPort)) {
					t.Errorf("%s: -join=%s, want the controllers' Serf addresses %s", p, p.flags["join"], strings.Join(c.dnsNames(serfPort), ","))
				}
			}
		}
		if clients == 0 {
			t.Errorf("%s: no workers or gateways", o.dir)
		}
	}
}

// TestNamespaces: every object of an overlay is in one namespace (the DNS
// names in the flags are short: they resolve in the pod's own namespace).
func TestNamespaces(t *testing.T) {
	for _, o := range renderAll(t) {
		ns := map[string]bool{}
		for _, s := range o.statefulSets {
			ns[s.Namespace] = true
		}
		for _, d := range o.deployments {
			ns[d.Namespace] = true
		}
		for _, s := range o.services {
			ns[s.Namespace] = true
		}
		for _, p := range o.pdbs {
			ns[p.Namespace] = true
		}
		for _, h := range o.hpas {
			ns[h.Namespace] = true
		}
		if len(ns) != 1 {
			t.Errorf("%s: objects in namespaces %v", o.dir, sortedKeys(ns))
		}
		if o.dir != "k8s/base" && (len(o.namespaces) != 1 || !ns[o.namespaces[0].Name]) {
			t.Errorf("%s: the overlay must create the namespace its objects are in (%v)", o.dir, sortedKeys(ns))
		}
	}
}

// TestWorkers: a StatefulSet behind a headless Service; ids are pod names;
// the preStop hook drains by migration with the command the binary has;
// the grace period leaves it time; the memory limit holds the checkpoint
// budget; one GPU per worker in the gpu overlay, none and the synthetic
// engine in dev.
func TestWorkers(t *testing.T) {
	cmds := commands(t)
	for _, p := range procs(t) {
		if p.sub != "worker" {
			continue
		}
		if p.w.kind != "StatefulSet" {
			t.Errorf("%s: workers run as a %s; the manifests and docs/deploy.md explain the StatefulSet", p, p.w.kind)
			continue
		}
		headless := false
		for _, s := range p.ov.services {
			headless = headless || (s.Name == p.w.service && s.Spec.ClusterIP == corev1.ClusterIPNone && selects(s.Spec.Selector, p.w.labels))
		}
		if !headless {
			t.Errorf("%s: serviceName %q is not a headless Service over the workers", p, p.w.service)
		}
		if p.raw["id"] != "$(POD_NAME)" {
			t.Errorf("%s: -id=%s: a worker's id must be its pod's stable name", p, p.raw["id"])
		}
		checkDrainHook(t, p, cmds)
		if g := p.w.pod.TerminationGracePeriodSeconds; g == nil || *g < 60 {
			t.Errorf("%s: terminationGracePeriodSeconds %v: the drain migrates every running request first; give it a minute or more", p, g)
		}
		budget := p.flags["checkpoint-budget"]
		if budget == "" {
			budget = flagDefault(t, "worker", "checkpoint-budget")
		}
		b, err := sizeBytes(budget)
		if err != nil {
			t.Errorf("%s: checkpoint budget: %v", p, err)
		}
		lim, ok := p.c.Resources.Limits[corev1.ResourceMemory]
		if !ok || lim.Cmp(*resource.NewQuantity(b, resource.BinarySI)) <= 0 {
			t.Errorf("%s: memory limit %v must exceed the checkpoint budget %s (the store holds other workers' checkpoints in this memory)", p, lim.String(), budget)
		}
		gpus := p.c.Resources.Limits["nvidia.com/gpu"]
		switch path.Base(p.ov.dir) {
		case "gpu", "autoscale":
			if gpus.Value() != 1 {
				t.Errorf("%s: nvidia.com/gpu limit %s, want 1: one worker per GPU", p, gpus.String())
			}
			if p.flags["profile"] == "" {
				t.Errorf("%s: no -profile: the GPU overlay runs the profile's engine timing", p)
			}
		case "dev":
			if !gpus.IsZero() || p.flags["engine"] != "synthetic" {
				t.Errorf("%s: the dev overlay runs the synthetic engine without GPUs (gpus %s, -engine=%s)", p, gpus.String(), p.flags["engine"])
			}
		}
	}
}

// checkDrainHook: preStop runs `lumen worker drain $POD_NAME -follow`
// through a shell (the kubelet expands $(VAR) in command and args only),
// against the controllers the worker registers with.
func checkDrainHook(t *testing.T, p *proc, cmds map[string]bool) {
	t.Helper()
	h := p.c.Lifecycle
	if h == nil || h.PreStop == nil || h.PreStop.Exec == nil {
		t.Errorf("%s: no preStop exec hook: a stopped worker would hand its requests back instead of migrating them", p)
		return
	}
	cmd := h.PreStop.Exec.Command
	if len(cmd) != 3 || cmd[0] != "/bin/sh" || cmd[1] != "-c" {
		t.Errorf("%s: preStop %q: want [/bin/sh -c SCRIPT]", p, cmd)
		return
	}
	words := strings.Fields(cmd[2])
	if len(words) > 0 && words[0] == "exec" {
		words = words[1:]
	}
	if len(words) < 4 || words[0] != "lumen" || words[1] != "worker" || words[2] != "drain" || strings.Trim(words[3], `"`) != "$POD_NAME" {
		t.Errorf("%s: preStop script %q: want exec lumen worker drain \"$POD_NAME\" [flags]", p, cmd[2])
		return
	}
	args := []string{"worker", "drain", p.w.podName()}
	for _, w := range words[4:] {
		args = append(args, strings.Trim(w, `"`))
	}
	hasFollow := false
	for _, a := range args[3:] {
		hasFollow = hasFollow || a == "-follow" || a == "-follow=true"
	}
	if !hasFollow {
		t.Errorf("%s: preStop drains without -follow: it returns at once, and SIGTERM then cuts the migrations short", p)
	}
	if p.env["LUMEN_ADDR"] != p.flags["controllers"] {
		t.Errorf("%s: LUMEN_ADDR=%q (the drain's controllers) differs from -controllers=%q", p, p.env["LUMEN_ADDR"], p.flags["controllers"])
	}
	if !cmds["worker drain"] {
		t.Logf("%s: this lumen has no `worker drain` command (live migration is not merged): the hook's flags are not checked", p)
		return
	}
	if err := checkFlags(args); err != nil {
		t.Errorf("%s: preStop: %v", p, err)
	}
}

// sizeBytes reads a size as lumen's flags write it: 48GiB, 512MiB, 80GB,
// 1048576.
func sizeBytes(s string) (int64, error) {
	units := []struct {
		suffix string
		mult   float64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1}, {"", 1}}
	for _, u := range units {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			f, err := strconv.ParseFloat(num, 64)
			if err != nil || f < 0 {
				return 0, fmt.Errorf("%q is not a size like 48GiB", s)
			}
			return int64(f * u.mult), nil
		}
	}
	return 0, nil
}

// flagDefault reads a flag's default from `lumen sub -h`.
func flagDefault(t *testing.T, sub, name string) string {
	t.Helper()
	b, _ := exec.Command(lumenBin, sub, "-h").CombinedOutput()
	out := string(b)
	re := regexp.MustCompile(`(?m)^  -` + regexp.QuoteMeta(name) + `( \S+)?\n\s+.*\(default "?([^")]*)"?\)`)
	m := re.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("lumen %s -h: no default for -%s in:\n%s", sub, name, out)
	}
	return m[2]
}

// TestServices: each Service selects pods of the overlay and targets ports
// their containers declare, with the same protocol.
func TestServices(t *testing.T) {
	for _, o := range renderAll(t) {
		for _, s := range o.services {
			var matched []workload
			for _, w := range o.workloads() {
				if selects(s.Spec.Selector, w.labels) {
					matched = append(matched, w)
				}
			}
			if len(matched) == 0 {
				t.Errorf("%s: Service %s selects %v: no pods", o.dir, s.Name, s.Spec.Selector)
				continue
			}
			for _, sp := range s.Spec.Ports {
				tp := sp.TargetPort
				if tp.Type == intstr.Int && tp.IntVal == 0 {
					tp = intstr.FromInt32(sp.Port)
				}
				for _, w := range matched {
					found := false
					for i := range w.pod.Containers {
						_, ok := namedPort(&w.pod.Containers[i], tp, sp.Protocol)
						found = found || ok
					}
					if !found {
						t.Errorf("%s: Service %s port %s targets %s/%s, which %s %s does not declare", o.dir, s.Name, sp.Name, tp.String(), sp.Protocol, w.kind, w.name)
					}
				}
			}
		}
	}
}

// TestSecrets: TLS files are on mounted Secrets that hold them; the
// gossip key is on every Serf member of an overlay or on none, and comes
// from a Secret; where the controllers serve mutual TLS every client has a
// certificate (the gateway's -cluster-tls-*, the others' -tls-*, the drain
// hook's too), and no probe of a mutual-TLS gRPC server is a gRPC probe
// (the kubelet's speaks no TLS).
func TestSecrets(t *testing.T) {
	ps := procs(t)
	for _, p := range ps {
		for _, f := range []string{"tls-cert", "tls-key", "tls-ca", "cluster-tls-cert", "cluster-tls-key", "cluster-tls-ca"} {
			file := p.flags[f]
			if file == "" {
				continue
			}
			var vol string
			for _, m := range p.c.VolumeMounts {
				if strings.HasPrefix(file, m.MountPath+"/") {
					vol = m.Name
				}
			}
			if vol == "" {
				t.Errorf("%s: -%s=%s is on no mounted volume", p, f, file)
				continue
			}
			for _, v := range p.w.pod.Volumes {
				if v.Name != vol || v.Secret == nil {
					continue
				}
				keys := map[string]bool{"tls.crt": true, "tls.key": true, "ca.crt": true}
				if len(v.Secret.Items) > 0 {
					keys = map[string]bool{}
					for _, it := range v.Secret.Items {
						keys[it.Path] = true
					}
				}
				if !keys[path.Base(file)] {
					t.Errorf("%s: -%s=%s: Secret %s has no key %s (a kubernetes.io/tls Secret holds tls.crt, tls.key, ca.crt)", p, f, file, v.Secret.SecretName, path.Base(file))
				}
			}
		}
		if p.flags["tls-cert"] != "" && p.sub != "gateway" {
			for name, pr := range map[string]*corev1.Probe{"startup": p.c.StartupProbe, "liveness": p.c.LivenessProbe, "readiness": p.c.ReadinessProbe} {
				if pr != nil && pr.GRPC != nil {
					t.Errorf("%s: the %s probe is gRPC, but the gRPC server asks for a client certificate the kubelet does not have: probe GET /healthz", p, name)
				}
			}
		}
		for _, e := range p.c.Env {
			if e.Name == "LUMEN_GOSSIP_KEY" && (e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil) {
				t.Errorf("%s: LUMEN_GOSSIP_KEY is written in the manifest: take it from a Secret (secretKeyRef)", p)
			}
		}
		if p.raw["gossip-key"] != "" {
			t.Errorf("%s: -gossip-key on the command line shows the key in every process list: set LUMEN_GOSSIP_KEY from a Secret", p)
		}
	}
	for _, o := range renderAll(t) {
		var keyed, plain []string
		for _, p := range ps {
			if p.ov != o || p.flags["serf-addr"] == "" {
				continue
			}
			if p.flags["gossip-key"] != "" || p.env["LUMEN_GOSSIP_KEY"] != "" {
				keyed = append(keyed, p.w.name)
			} else {
				plain = append(plain, p.w.name)
			}
		}
		if len(keyed) > 0 && len(plain) > 0 {
			t.Errorf("%s: the gossip key on %v but not on %v, which gossip with them", o.dir, keyed, plain)
		}
		c := controllers(t, ps, o)
		if c.flags["tls-cert"] == "" {
			continue
		}
		for _, p := range ps {
			if p.ov != o || p.sub == "controller" {
				continue
			}
			prefix := "tls-"
			if p.sub == "gateway" {
				prefix = "cluster-tls-" // its -tls-* serve HTTPS
			}
			if p.flags[prefix+"ca"] == "" || p.flags[prefix+"cert"] == "" || p.flags[prefix+"key"] == "" {
				t.Errorf("%s: the controllers serve mutual TLS, but this client has no -%sca, -%scert and -%skey", p, prefix, prefix, prefix)
			}
			if h := p.c.Lifecycle; p.sub == "worker" && h != nil && h.PreStop != nil && h.PreStop.Exec != nil {
				script := strings.Join(h.PreStop.Exec.Command, " ")
				for _, f := range []string{"-tls-cert=", "-tls-key=", "-tls-ca="} {
					if !strings.Contains(script, f+p.flags[strings.TrimSuffix(strings.TrimPrefix(f, "-"), "=")]) {
						t.Errorf("%s: the preStop drain has no %s%s: the controllers would refuse it", p, f, p.flags[strings.TrimSuffix(strings.TrimPrefix(f, "-"), "=")])
					}
				}
			}
		}
	}
}
