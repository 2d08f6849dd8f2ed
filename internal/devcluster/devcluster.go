// Package devcluster runs lumen processes on one machine for the demo, the
// benchmarks and the fault-injection suite: each process is a real `lumen`
// subcommand with its own data directory and log file, on loopback ports,
// killed with SIGKILL when a test says so.
package devcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/healthz"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Controller is one controller process.
type Controller struct {
	ID       string
	DataDir  string
	LogPath  string
	RaftAddr string
	GRPCAddr string
	SerfAddr string
	HTTPAddr string

	index int
	host  string // its own address, with Options.Hosts
	fixed bool   // its addresses came from Options.Addrs: never re-picked
	cmd   *exec.Cmd
	done  chan struct{}
}

// Running reports whether the process is alive.
func (c *Controller) Running() bool {
	if c.cmd == nil {
		return false
	}
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

// Pid returns the process id, or 0.
func (c *Controller) Pid() int {
	if !c.Running() {
		return 0
	}
	return c.cmd.Process.Pid
}

// Options configures a local quorum.
type Options struct {
	// Bin is the lumen binary; empty means this executable.
	Bin string
	// Dir holds each replica's data directory and log.
	Dir string
	// Controllers is the quorum size (3 or 5).
	Controllers int
	// Args are extra flags for every controller.
	Args []string
	// Hosts, when set, gives controller i its own IP address (its ports
	// are then fixed: 7000 Raft, 7100 gRPC, 7200 Serf, 7300 HTTP), and
	// Wrap(i) the command prefix that runs it where that address lives
	// (for example "ip netns exec NS"). WorkerHost is the address workers
	// and the gateway bind, reachable from the controllers.
	Hosts      []string
	Wrap       func(i int) []string
	WorkerHost string
	// ControllerArgs, when set, gives controller i flags of its own.
	ControllerArgs func(i int) []string
	// ClientAddr, when set, is the address workers, the gateway and
	// GRPCAddrs give for controller i instead of its gRPC address (a
	// proxy in front of it).
	ClientAddr func(i int) string
	// Addrs, when set, gives controller i the addresses Addrs[i] instead
	// of free ports picked now: a quorum restarted from its data
	// directories must come back where its Raft configuration says it
	// is. A controller that cannot bind them is not moved elsewhere;
	// Launch fails with ErrAddrTaken.
	Addrs []ControllerAddrs
}

// ControllerAddrs are the four addresses of one controller.
type ControllerAddrs struct {
	Raft string `json:"raft"`
	GRPC string `json:"grpc"`
	Serf string `json:"serf"`
	HTTP string `json:"http"`
}

// Errors of the package.
var (
	// ErrAddrTaken: a controller given fixed addresses (Options.Addrs)
	// exited at start, most likely because one of them is in use.
	ErrAddrTaken = errors.New("devcluster: a controller could not start on its recorded addresses")
)

// ControllerID is the id of controller i (0-based): ctl1, ctl2, ...
func ControllerID(i int) string { return fmt.Sprintf("ctl%d", i+1) }

// Cluster is a local controller quorum.
type Cluster struct {
	opts Options
	// addrMu guards the controllers' addresses while Launch may pick new
	// ones (a port taken at start); read them with Addrs meanwhile.
	addrMu      sync.Mutex
	Controllers []*Controller
	Workers     []*Worker
	// Gateway is the gateway started last; Gateways every one started,
	// in order (the first logs to gateway.log, the n-th to gateway-n.log).
	Gateway  *Gateway
	Gateways []*Gateway
}

// FreePort returns a loopback port free for both TCP and UDP now, and
// never handed out or reserved before in this process.
func FreePort() (int, error) { return freePortOn("127.0.0.1") }

// taken holds the ports this process has handed out or reserved: a port
// is free only until its user binds it, and the kernel may offer a port
// it just released again, so without it two components (or a component
// and an address the caller named, see Reserve) could get the same port.
var taken = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// Reserve keeps FreePort from handing out addr's port: an address the
// caller named and binds later (lumen dev's -http, picked by whoever ran
// it). An address without a numeric port reserves nothing.
func Reserve(addr string) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return
	}
	if port, err := strconv.Atoi(p); err == nil && port > 0 {
		taken.Lock()
		taken.ports[port] = true
		taken.Unlock()
	}
}

// listenTCP is net.Listen; a test replaces it to make the kernel offer a
// port again.
var listenTCP = net.Listen

func freePortOn(host string) (int, error) {
	for i := 0; i < 50; i++ {
		l, err := listenTCP("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		taken.Lock()
		seen := taken.ports[port]
		taken.Unlock()
		if seen {
			continue
		}
		if u, err := net.ListenPacket("udp", net.JoinHostPort(host, strconv.Itoa(port))); err == nil {
			u.Close()
			taken.Lock()
			taken.ports[port] = true
			taken.Unlock()
			return port, nil
		}
	}
	return 0, errors.New("devcluster: no free loopback port")
}

func freeAddr() (string, error) { return freeAddrOn("127.0.0.1") }

func freeAddrOn(host string) (string, error) {
	p, err := freePortOn(host)
	return net.JoinHostPort(host, strconv.Itoa(p)), err
}

// workerAddr is a free address where the controllers can reach a worker or
// the gateway.
func (c *Cluster) workerAddr() (string, error) {
	if c.opts.WorkerHost != "" {
		return freeAddrOn(c.opts.WorkerHost)
	}
	return freeAddr()
}

// Start launches the quorum and waits until it has a leader.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	c, err := Prepare(opts)
	if err != nil {
		return nil, err
	}
	if err := c.Launch(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// Prepare picks every controller's id, directories and addresses without
// starting anything, for a caller that must know them first (a proxy in
// front of them); Launch starts them.
func Prepare(opts Options) (*Cluster, error) {
	if opts.Bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		opts.Bin = exe
	}
	if opts.Controllers <= 0 {
		opts.Controllers = 3
	}
	c := &Cluster{opts: opts}
	for i := 0; i < opts.Controllers; i++ {
		ctl := &Controller{ID: ControllerID(i), index: i}
		ctl.DataDir = filepath.Join(opts.Dir, ctl.ID)
		ctl.LogPath = filepath.Join(opts.Dir, ctl.ID+".log")
		if i < len(opts.Hosts) {
			ctl.host = opts.Hosts[i]
		}
		if i < len(opts.Addrs) {
			a := opts.Addrs[i]
			ctl.RaftAddr, ctl.GRPCAddr, ctl.SerfAddr, ctl.HTTPAddr = a.Raft, a.GRPC, a.Serf, a.HTTP
			ctl.fixed = true
		} else if err := ctl.pickAddrs(); err != nil {
			return nil, err
		}
		c.Controllers = append(c.Controllers, ctl)
	}
	return c, nil
}

// ControllerAddrs returns every controller's addresses, to record them for a later
// restart from the same data directories (Options.Addrs).
func (c *Cluster) ControllerAddrs() []ControllerAddrs {
	c.addrMu.Lock()
	defer c.addrMu.Unlock()
	out := make([]ControllerAddrs, len(c.Controllers))
	for i, ctl := range c.Controllers {
		out[i] = ControllerAddrs{Raft: ctl.RaftAddr, GRPC: ctl.GRPCAddr, Serf: ctl.SerfAddr, HTTP: ctl.HTTPAddr}
	}
	return out
}

// Launch starts the prepared quorum and waits until it has a leader; when
// ctx ends first it stops what it started and returns ctx's error.
func (c *Cluster) Launch(ctx context.Context) error {
	for i := range c.Controllers {
		if err := c.Restart(i); err != nil {
			c.Stop()
			return err
		}
	}
	// A port handed out by FreePort can be taken (by another process's
	// outgoing connection) before the controller binds it; a controller that
	// exits while the quorum forms gets fresh ports and another try.
	retries := 0
	for {
		wctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := c.WaitLeader(wctx)
		cancel()
		if err == nil && !c.fixedExited() {
			return nil
		}
		for i, ctl := range c.Controllers {
			if ctl.Running() {
				continue
			}
			if ctl.fixed {
				c.Stop()
				return fmt.Errorf("%w: %s exited (raft %s, grpc %s, serf %s, http %s; log: %s)",
					ErrAddrTaken, ctl.ID, ctl.RaftAddr, ctl.GRPCAddr, ctl.SerfAddr, ctl.HTTPAddr, ctl.LogPath)
			}
			if retries++; retries > 3*len(c.Controllers) {
				c.Stop()
				return fmt.Errorf("devcluster: %s keeps exiting at start (log: %s)", ctl.ID, ctl.LogPath)
			}
			c.addrMu.Lock()
			err := ctl.pickAddrs()
			c.addrMu.Unlock()
			if err != nil {
				c.Stop()
				return err
			}
			if err := c.Restart(i); err != nil {
				c.Stop()
				return err
			}
		}
		if ctx.Err() != nil {
			c.Stop()
			return fmt.Errorf("devcluster: no leader: %w (logs in %s)", ctx.Err(), c.opts.Dir)
		}
	}
}

// fixedExited reports whether a controller on fixed addresses has exited:
// the others may elect a leader without it, but it is not coming back.
func (c *Cluster) fixedExited() bool {
	for _, ctl := range c.Controllers {
		if ctl.fixed && !ctl.Running() {
			return true
		}
	}
	return false
}

func (ctl *Controller) pickAddrs() error {
	if ctl.host != "" {
		ctl.RaftAddr, ctl.GRPCAddr = ctl.host+":7000", ctl.host+":7100"
		ctl.SerfAddr, ctl.HTTPAddr = ctl.host+":7200", ctl.host+":7300"
		return nil
	}
	var err error
	for _, p := range []*string{&ctl.RaftAddr, &ctl.GRPCAddr, &ctl.SerfAddr, &ctl.HTTPAddr} {
		if *p, err = freeAddr(); err != nil {
			return err
		}
	}
	return nil
}

// Addrs returns controller i's Raft and gRPC addresses; safe while Launch
// runs.
func (c *Cluster) Addrs(i int) (raft, grpc string) {
	c.addrMu.Lock()
	defer c.addrMu.Unlock()
	return c.Controllers[i].RaftAddr, c.Controllers[i].GRPCAddr
}

// GRPCAddrs lists every controller's API address, as clients reach it
// (Options.ClientAddr).
func (c *Cluster) GRPCAddrs() []string {
	out := make([]string, len(c.Controllers))
	for i, ctl := range c.Controllers {
		out[i] = ctl.GRPCAddr
		if c.opts.ClientAddr != nil {
			out[i] = c.opts.ClientAddr(i)
		}
	}
	return out
}

// DashboardURL is the address of controller i's dashboard (package ui).
func (c *Cluster) DashboardURL(i int) string {
	c.addrMu.Lock()
	defer c.addrMu.Unlock()
	return "http://" + c.Controllers[i].HTTPAddr + "/ui"
}

// Restart starts controller i (again) from its data directory.
func (c *Cluster) Restart(i int) error {
	ctl := c.Controllers[i]
	if ctl.Running() {
		return fmt.Errorf("devcluster: %s is running", ctl.ID)
	}
	var join []string
	for j, o := range c.Controllers {
		if j != i {
			join = append(join, o.SerfAddr)
		}
	}
	args := []string{"controller", "-id", ctl.ID, "-data-dir", ctl.DataDir,
		"-raft-addr", ctl.RaftAddr, "-grpc-addr", ctl.GRPCAddr, "-serf-addr", ctl.SerfAddr, "-http-addr", ctl.HTTPAddr,
		"-bootstrap-expect", strconv.Itoa(len(c.Controllers)), "-join", strings.Join(join, ",")}
	args = append(args, c.opts.Args...)
	if c.opts.ControllerArgs != nil {
		args = append(args, c.opts.ControllerArgs(i)...)
	}
	var wrap []string
	if c.opts.Wrap != nil {
		wrap = c.opts.Wrap(i) // it execs lumen in place: the pid stays the controller's
	}
	var err error
	ctl.cmd, ctl.done, err = c.spawn(ctl.ID, ctl.LogPath, wrap, args)
	return err
}

// Signal sends sig to controller i (SIGSTOP, SIGCONT, ...).
func (c *Cluster) Signal(i int, sig syscall.Signal) error {
	ctl := c.Controllers[i]
	if !ctl.Running() {
		return fmt.Errorf("devcluster: %s is not running", ctl.ID)
	}
	return ctl.cmd.Process.Signal(sig)
}

// spawn starts `lumen args...` with its output appended to logPath, in its
// own process group and killed with its parent; done closes when it exits.
func (c *Cluster) spawn(name, logPath string, wrap, args []string) (*exec.Cmd, chan struct{}, error) {
	if err := os.MkdirAll(c.opts.Dir, 0o755); err != nil {
		return nil, nil, err
	}
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, err
	}
	argv := append([]string{c.opts.Bin}, args...)
	if wrap != nil {
		argv = append(append([]string(nil), wrap...), argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, nil, fmt.Errorf("devcluster: start %s: %w", name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	return cmd, done, nil
}

// Kill sends SIGKILL to controller i and waits for it to die.
func (c *Cluster) Kill(i int) {
	ctl := c.Controllers[i]
	if !ctl.Running() {
		return
	}
	_ = ctl.cmd.Process.Signal(syscall.SIGKILL)
	<-ctl.done
}

// Stop terminates every worker, then every controller (SIGTERM, then
// SIGKILL after a grace period).
func (c *Cluster) Stop() {
	for _, g := range c.Gateways {
		g.stop()
	}
	c.StopWorkers()
	for _, ctl := range c.Controllers {
		if ctl.Running() {
			_ = ctl.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for i, ctl := range c.Controllers {
		if !ctl.Running() {
			continue
		}
		select {
		case <-ctl.done:
		case <-time.After(5 * time.Second):
			c.Kill(i)
		}
	}
}

// Status asks controller i for its view of the cluster.
func (c *Cluster) Status(ctx context.Context, i int) (*pb.ClusterStatusResponse, error) {
	cl, err := ctlclient.New([]string{c.Controllers[i].GRPCAddr}, nil)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	return cl.ClusterStatus(ctx)
}

// SetCheckpointReplicas sets the strategy's replication factor r (1 …
// policy.MaxCheckpointReplicas) through the quorum, as `lumen strategy set
// -checkpoint-replicas r` does.
func (c *Cluster) SetCheckpointReplicas(ctx context.Context, r int) error {
	cl, err := ctlclient.New(c.GRPCAddrs(), nil)
	if err != nil {
		return err
	}
	defer cl.Close()
	if err := cl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
		_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{CheckpointReplicas: uint32(r)})
		return err
	}); err != nil {
		return fmt.Errorf("devcluster: set checkpoint replicas %d: %w", r, err)
	}
	return nil
}

// WaitLeader waits until a running controller reports itself the leader and
// every running controller names it, and returns the leader's index.
func (c *Cluster) WaitLeader(ctx context.Context) (int, error) {
	for {
		if i, ok := c.agreedLeader(ctx); ok {
			return i, nil
		}
		select {
		case <-ctx.Done():
			return -1, fmt.Errorf("devcluster: no leader: %w (logs in %s)", ctx.Err(), c.opts.Dir)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (c *Cluster) agreedLeader(ctx context.Context) (int, bool) {
	leader, leaderID := -1, ""
	for i, ctl := range c.Controllers {
		if !ctl.Running() {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		st, err := c.Status(sctx, i)
		cancel()
		if err != nil || st.LeaderId == "" || (leaderID != "" && st.LeaderId != leaderID) {
			return -1, false
		}
		leaderID = st.LeaderId
		if st.State == "Leader" && st.LeaderId == ctl.ID {
			leader = i
		}
	}
	return leader, leader >= 0
}

// Worker is one worker process.
type Worker struct {
	ID       string
	DataDir  string
	LogPath  string
	GRPCAddr string
	SerfAddr string
	HTTPAddr string
	Args     []string

	cmd  *exec.Cmd
	done chan struct{}
}

// Running reports whether the process is alive.
func (w *Worker) Running() bool {
	if w.cmd == nil {
		return false
	}
	select {
	case <-w.done:
		return false
	default:
		return true
	}
}

// AddWorker starts a worker process joined to the quorum; args are extra
// flags (engine, profile, ...). It waits until the worker serves HTTP, and
// gives it fresh ports when it exits at start (a port taken meanwhile).
func (c *Cluster) AddWorker(id string, args ...string) (*Worker, error) {
	return c.AddWorkerContext(context.Background(), id, args...)
}

// AddWorkerContext is AddWorker that gives up, and stops the worker, when
// ctx ends.
func (c *Cluster) AddWorkerContext(ctx context.Context, id string, args ...string) (*Worker, error) {
	w := &Worker{ID: id, DataDir: filepath.Join(c.opts.Dir, id), LogPath: filepath.Join(c.opts.Dir, id+".log"), Args: args}
	c.Workers = append(c.Workers, w)
	for attempt := 0; ; attempt++ {
		var err error
		for _, p := range []*string{&w.GRPCAddr, &w.SerfAddr, &w.HTTPAddr} {
			if *p, err = c.workerAddr(); err != nil {
				return nil, err
			}
		}
		if err := c.StartWorker(w); err != nil {
			return nil, err
		}
		if w.waitServing(ctx, 60*time.Second) {
			return w, nil
		}
		if ctx.Err() != nil {
			c.KillWorker(w)
			return nil, fmt.Errorf("devcluster: worker %s: %w", id, ctx.Err())
		}
		if w.Running() || attempt == 2 {
			return nil, fmt.Errorf("devcluster: worker %s did not start (log: %s)", id, w.LogPath)
		}
	}
}

// waitServing waits until the worker answers /healthz, or exits, or ctx
// ends.
func (w *Worker) waitServing(ctx context.Context, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return pollHealthz(ctx, w.HTTPAddr, w.cmd.Process.Pid, w.done)
}

// pollHealthz polls http://addr/healthz until process pid answers it,
// exited closes or ctx ends. An answer from another process (one that took
// the port before pid could bind it) does not count: pid will exit.
func pollHealthz(ctx context.Context, addr string, pid int, exited <-chan struct{}) bool {
	client := &http.Client{Timeout: time.Second}
	for {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/healthz", nil)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if healthz.From(resp, pid) {
				return true
			}
		}
		select {
		case <-ctx.Done():
			return false
		case <-exited:
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StartWorker starts (or restarts, with a new incarnation) a worker.
func (c *Cluster) StartWorker(w *Worker) error {
	if w.Running() {
		return fmt.Errorf("devcluster: %s is running", w.ID)
	}
	var serf []string
	for _, ctl := range c.Controllers {
		serf = append(serf, ctl.SerfAddr)
	}
	args := append([]string{"worker", "-id", w.ID, "-data-dir", w.DataDir, "-grpc-addr", w.GRPCAddr,
		"-serf-addr", w.SerfAddr, "-http-addr", w.HTTPAddr, "-join", strings.Join(serf, ","),
		"-controllers", strings.Join(c.GRPCAddrs(), ","), "-log-level", "warn"}, w.Args...)
	var err error
	w.cmd, w.done, err = c.spawn(w.ID, w.LogPath, nil, args)
	return err
}

// KillWorker sends SIGKILL to a worker and waits for it to die.
func (c *Cluster) KillWorker(w *Worker) {
	if w.Running() {
		_ = w.cmd.Process.Signal(syscall.SIGKILL)
		<-w.done
	}
}

// StopWorkers terminates every worker (SIGTERM: they drain), then SIGKILL
// after 10 s.
func (c *Cluster) StopWorkers() {
	for _, w := range c.Workers {
		if w.Running() {
			_ = w.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, w := range c.Workers {
		if !w.Running() {
			continue
		}
		select {
		case <-w.done:
		case <-time.After(10 * time.Second):
			c.KillWorker(w)
		}
	}
}

// Gateway is a gateway process.
type Gateway struct {
	Name    string // gateway, gateway-2, ...
	Addr    string
	LogPath string
	args    []string
	// cells, when set, are the gateway's -cell values (CellFlag): it
	// places into those cells in place of this cluster's controllers.
	cells []string
	cmd   *exec.Cmd
	done  chan struct{}
}

// CellFlag is the gateway's -cell value that names cluster c as cell name.
func (c *Cluster) CellFlag(name string) string { return name + "=" + strings.Join(c.GRPCAddrs(), ",") }

// StartCellsGateway starts a gateway over cells (issue 26: -cell values
// from CellFlag, one per cluster), its log in this cluster's directory, as
// StartGatewayContext does otherwise.
func (c *Cluster) StartCellsGateway(ctx context.Context, addr string, cells []string, args ...string) (*Gateway, error) {
	return c.startGateway(ctx, addr, cells, args)
}

// Running reports whether the process is alive.
func (g *Gateway) Running() bool {
	if g.cmd == nil {
		return false
	}
	select {
	case <-g.done:
		return false
	default:
		return true
	}
}

// StartGateway starts a gateway process on addr (empty: a free port, and
// fresh ones if the gateway exits at start because it was taken). The
// first gateway is "gateway", the n-th "gateway-n".
func (c *Cluster) StartGateway(addr string, args ...string) (*Gateway, error) {
	return c.StartGatewayContext(context.Background(), addr, args...)
}

// StartGatewayContext is StartGateway that gives up, and stops the gateway,
// when ctx ends.
func (c *Cluster) StartGatewayContext(ctx context.Context, addr string, args ...string) (*Gateway, error) {
	return c.startGateway(ctx, addr, nil, args)
}

func (c *Cluster) startGateway(ctx context.Context, addr string, cells, args []string) (*Gateway, error) {
	name := "gateway"
	if n := len(c.Gateways); n > 0 {
		name = fmt.Sprintf("gateway-%d", n+1)
	}
	g := &Gateway{Name: name, Addr: addr, LogPath: filepath.Join(c.opts.Dir, name+".log"), args: args, cells: cells}
	c.Gateway = g
	c.Gateways = append(c.Gateways, g)
	auto := addr == ""
	for attempt := 0; ; attempt++ {
		if auto {
			var err error
			if g.Addr, err = c.workerAddr(); err != nil {
				return nil, err
			}
		}
		if err := c.spawnGateway(g); err != nil {
			return nil, err
		}
		if g.waitListening(ctx, 30*time.Second) {
			return g, nil
		}
		if ctx.Err() != nil {
			g.stop()
			return nil, fmt.Errorf("devcluster: gateway: %w", ctx.Err())
		}
		if !auto || attempt == 2 {
			g.stop()
			return nil, fmt.Errorf("devcluster: %s did not start listening on %s: is the address in use? (log: %s)", g.Name, g.Addr, g.LogPath)
		}
	}
}

func (c *Cluster) spawnGateway(g *Gateway) error {
	var err error
	args := []string{"gateway", "-http", g.Addr, "-log-level", "warn"}
	if len(g.cells) == 0 {
		args = append(args, "-controllers", strings.Join(c.GRPCAddrs(), ","))
	}
	for _, cell := range g.cells {
		args = append(args, "-cell", cell)
	}
	g.cmd, g.done, err = c.spawn(g.Name, g.LogPath, nil, append(args, g.args...))
	return err
}

// KillGateway sends SIGKILL to a gateway and waits for it to die.
func (c *Cluster) KillGateway(g *Gateway) {
	if g.Running() {
		_ = g.cmd.Process.Signal(syscall.SIGKILL)
		<-g.done
	}
}

// RestartGateway starts a stopped gateway again on its address, with its
// flags, appending to its log; it does not wait for it to listen.
func (c *Cluster) RestartGateway(g *Gateway) error {
	if g.Running() {
		return fmt.Errorf("devcluster: %s is running", g.Name)
	}
	return c.spawnGateway(g)
}

// waitListening waits until the gateway answers /healthz, or exits, or ctx
// ends.
func (g *Gateway) waitListening(ctx context.Context, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return pollHealthz(ctx, g.Addr, g.cmd.Process.Pid, g.done)
}

// WaitReady polls the gateway's /readyz until it answers 200.
func (g *Gateway) WaitReady(ctx context.Context) error {
	for {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+g.Addr+"/readyz", nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 && g.cmd != nil && healthz.From(resp, g.cmd.Process.Pid) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("devcluster: gateway not ready: %w", ctx.Err())
		case <-g.done:
			return fmt.Errorf("devcluster: gateway exited (log: %s)", g.LogPath)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (g *Gateway) stop() {
	if g == nil || !g.Running() {
		return
	}
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-g.done:
	case <-time.After(10 * time.Second):
		_ = g.cmd.Process.Signal(syscall.SIGKILL)
		<-g.done
	}
}

// PauseWorker stops a worker with SIGSTOP (it hangs: connections stay open,
// nothing answers); ResumeWorker continues it.
func (c *Cluster) PauseWorker(w *Worker) error { return w.cmd.Process.Signal(syscall.SIGSTOP) }

// ResumeWorker sends SIGCONT.
func (c *Cluster) ResumeWorker(w *Worker) error { return w.cmd.Process.Signal(syscall.SIGCONT) }

// SignalWorker sends sig to a running worker.
func (c *Cluster) SignalWorker(w *Worker, sig syscall.Signal) error {
	if !w.Running() {
		return fmt.Errorf("devcluster: %s is not running", w.ID)
	}
	return w.cmd.Process.Signal(sig)
}
