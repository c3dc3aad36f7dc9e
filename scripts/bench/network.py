#!/usr/bin/env python
"""Wall-clock per training step under limited bandwidth: 4 (--workers: 2..8) Horovod workers, each in
its own network namespace, linked through a bridge with tc-shaped veths, time per step for none
(fp32), fp16, QSGDinf and ALQ (allgather and two-phase exchange), as ratios to none and to fp16.
Needs root (ip netns, tc).

    python -m scripts.bench.network --out-dir docs/results                 # unshaped, 1gbit, 100mbit
    python -m scripts.bench.network --quick --out-dir /tmp/net     # small model, 1 rate, 2 steps

Topology (created by this script, torn down at the end, also on failure, Ctrl-C or SIGTERM):

    netns alqnet-w0 .. alqnet-w3   eth0 = 10.213.0.1 .. 10.213.0.4/24, tc tbf egress at --rates
                                   (--workers N: w0 .. w{N-1})
    netns alqnet-head              eth0 = 10.213.0.100/24 (unshaped; mpirun runs here)
    netns alqnet-br                bridge br0 with the peer veths (tbf egress toward each worker)

Only interfaces inside these namespaces are created or shaped: the machine's own interfaces,
loopback and routing are never touched. Each worker's link is shaped in both directions (its own
eth0 egress and the bridge port toward it), like a full-duplex NIC of the given rate per worker.

Launch: mpirun runs in the head namespace with a hostfile of the four worker addresses and
``--mca plm_rsh_agent <agent>``; the agent is a small shell script (written to a temp dir) that maps
the address to the worker's namespace and runs Open MPI's orted there with ``ip netns exec``.
Every rank of a launch must run within a minute (:func:`launch` polls each namespace for the
orted's children); otherwise mpirun and everything in the namespaces are killed, the namespaces
missing ranks are named (with or without an orted), and the launch is tried once more
(:func:`launch_retry`); the caller's ``finally`` tears the namespaces down either way.

Node layout (scripts/bench/train_step.py --nodes K --ranks-per-node G): ``setup(K)`` makes K
worker namespaces and ``mpirun_command(..., n=K, ranks_per_node=G)`` puts G consecutive ranks in
each (``slots=G``, ``--map-by slot``; Open MPI's local size G, ``HOROVOD_ALQ_LOCAL_SIZE=G``
exported). The G ranks of a node reach each other at their namespace's own address, which Linux
routes over the namespace's loopback: unshaped, and not in eth0's counters. Only traffic between
nodes crosses the shaped veths; :func:`link_counters` reads each node's eth0 bytes.
Open MPI's out-of-band and TCP BTL traffic are restricted to 10.213.0.0/24 (``btl self,tcp``: no
shared memory between ranks, since they are on "different hosts"), so every byte of the gradient
exchange between nodes crosses the shaped veths (with ``intra="shm"`` the ranks of one node use
shared memory between them). Horovod uses MPI for its CPU collectives (HOROVOD_CPU_OPERATIONS=mpi).

The model is a wide MLP (784 -> H -> H -> 10, about 20.0M parameters for H = 4096) with a batch of
8 per worker: communication dominates. Each method runs --warmup untimed then --steps timed steps;
the reported time is the median over steps of the slowest rank's step time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "alqnet"
SUBNET = "10.213.0"
N_WORKERS = 4
METHODS = ["none", "fp16", "qsgdinf", "alq", "alq-2p"]
LABELS = {
    "none": "none (fp32)",
    "fp16": "fp16",
    "qsgdinf": "QSGDinf 3b",
    "alq": "ALQ 3b allgather",
    "alq-2p": "ALQ 3b two-phase",
    "alq-auto": "ALQ bits='auto' allgather",
    "alq-auto-2p": "ALQ bits='auto' two-phase",
}  # (the last two: --methods; budget --bit-budget)


# ---------------------------------------------------------------------------------------- worker
def worker(args) -> int:
    """Runs on every rank (inside its namespace): time training steps per method."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    hvd.init()
    torch.set_num_threads(1)
    from horovod_alq.torch import ALQCompressor, QSGDCompressor

    common = dict(bits=args.bits, bucket_size=args.bucket_size, update_steps=(0,), update_every=0, seed=1)
    auto = dict(common, bits="auto", bit_budget=args.bit_budget)  # allocated at step 0, used from step 1
    comps = {
        "none": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "qsgdinf": QSGDCompressor(**common, exchange="allgather"),
        "alq": ALQCompressor(**common, exchange="allgather"),
        "alq-2p": ALQCompressor(**common, exchange="two-phase"),
        "alq-auto": ALQCompressor(**auto, exchange="allgather"),
        "alq-auto-2p": ALQCompressor(**auto, exchange="two-phase"),
    }
    h = args.hidden
    results = {}
    for method in args.methods.split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(784, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10)
        )
        params = sum(p.numel() for p in model.parameters())
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            compression=comps[method],
        )
        x = torch.randn(args.batch_size, 784)
        y = torch.randint(0, 10, (args.batch_size,))
        times, compute = [], []
        for step in range(args.warmup + args.steps):
            hvd.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if step >= args.warmup:
                times.append(t2 - t0)
                compute.append(t1 - t0)
        per_rank = hvd.allgather_object((times, compute))
        step_max = [max(r[0][i] for r in per_rank) for i in range(len(times))]
        results[method] = {
            "step_s": statistics.median(step_max),
            "steps": step_max,
            "compute_s": statistics.median(max(r[1][i] for r in per_rank) for i in range(len(times))),
            "params": params,
        }
        if hasattr(comps[method], "metrics"):  # this package's compressors: payload bytes on the wire
            m = comps[method].metrics()
            rounds = max(1, m["step"])
            results[method].update(
                exchange=m["exchange"],
                bytes_sent_per_step=m["bytes_sent"] / rounds,
                bytes_received_per_step=m["bytes_received"] / rounds,
                allocation=m.get("allocation"),
                allocated_mean_bits=m.get("allocated_mean_bits"),
            )
        del opt
    if hvd.rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"size": hvd.size(), "results": results}))
    hvd.shutdown()
    return 0


# ---------------------------------------------------------------------------------------- network
def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, shell=True, text=True, capture_output=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{cmd}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def ns_names() -> list[str]:
    return [f"{PREFIX}-w{i}" for i in range(8)] + [f"{PREFIX}-head", f"{PREFIX}-br"]


def existing_namespaces() -> list[str]:
    out = sh("ip netns list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip() and line.split()[0] in ns_names()]


def kill_in_namespaces() -> None:
    """SIGKILL every process in our namespaces (orteds, ranks, agents); the namespaces stay."""
    for ns in existing_namespaces():
        for pid in sh(f"ip netns pids {ns}", check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def teardown() -> list[str]:
    """Kill processes left in our namespaces, delete the namespaces (their veths go with them).
    Returns the namespaces still present afterwards (should be empty)."""
    kill_in_namespaces()
    for ns in existing_namespaces():
        sh(f"ip netns del {ns}", check=False)
    for folder in Path("/dev/shm").glob(f"{PREFIX}-w*"):  # the agent's shared-memory folders
        shutil.rmtree(folder, ignore_errors=True)
    return existing_namespaces()


def setup(n: int | None = None) -> None:
    """The bridge, the head and ``n`` (default N_WORKERS) worker namespaces."""
    br = f"{PREFIX}-br"
    sh(f"ip netns add {br}")
    sh(f"ip -n {br} link set lo up")
    sh(f"ip -n {br} link add br0 type bridge")
    sh(f"ip -n {br} link set br0 up")
    hosts = [(f"{PREFIX}-w{i}", f"{SUBNET}.{i + 1}", f"p{i}") for i in range(N_WORKERS if n is None else n)]
    hosts.append((f"{PREFIX}-head", f"{SUBNET}.100", "phead"))
    for ns, ip, port in hosts:
        sh(f"ip netns add {ns}")
        # create the pair inside the bridge namespace, then move one end: nothing in the root namespace
        sh(f"ip -n {br} link add {port} type veth peer name eth0 netns {ns}")
        sh(f"ip -n {br} link set {port} master br0 up")
        sh(f"ip -n {ns} link set lo up")
        sh(f"ip -n {ns} addr add {ip}/24 dev eth0")
        sh(f"ip -n {ns} link set eth0 up")
    # connectivity is checked by measure_throughput (no ping on this machine)


def shape(rate: str | None, n: int | None = None) -> None:
    """tbf on both ends of every worker link (never the head's link, whose traffic is control only);
    ``n``: the first n workers (default N_WORKERS)."""
    br = f"{PREFIX}-br"
    for i in range(N_WORKERS if n is None else n):
        for cmd_ns, dev in ((f"{PREFIX}-w{i}", "eth0"), (br, f"p{i}")):
            sh(f"ip netns exec {cmd_ns} tc qdisc del dev {dev} root", check=False)
            if rate:
                bits = parse_rate(rate)
                burst = max(64 * 1024, int(bits / 8 / 250 * 2))  # >= 2 timer ticks at HZ=250, >= one GSO frame
                sh(f"ip netns exec {cmd_ns} tc qdisc add dev {dev} root tbf rate {rate} burst {burst} latency 100ms")


def parse_rate(rate: str) -> float:
    r = rate.lower().removesuffix("bit").removesuffix("bps")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(r[-1], 1)
    return float(r.rstrip("kmg")) * scale


def measure_throughput(seconds: float = 2.0) -> float:
    """Bytes/s from w0 to w1 over the shaped link (one TCP stream, Python sockets)."""
    code = (
        "import socket,sys,time\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{ip}',5999));s.listen(1)\n"
        "c,_=s.accept();n=0;t=time.time()\n"
        "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
        "print(n/(time.time()-t))"
    )
    server = subprocess.Popen(
        ["ip", "netns", "exec", f"{PREFIX}-w1", sys.executable, "-c", code.format(ip=f"{SUBNET}.2")],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    client = (
        "import socket,time\ns=socket.create_connection(('{ip}',5999));b=bytes(1<<20);t=time.time()\n"
        "while time.time()-t<{sec}: s.sendall(b)\ns.close()"
    ).format(ip=f"{SUBNET}.2", sec=seconds)
    sh(f"ip netns exec {PREFIX}-w0 {sys.executable} -c {shlex.quote(client)}")
    out, _ = server.communicate(timeout=30)
    return float(out.strip())


AGENT = """#!/bin/sh
# Open MPI rsh agent: "$1" is the host (a worker address), the rest is the command for a shell.
host="$1"; shift
case "$host" in
{cases}
  *) echo "agent: unknown host $host" >&2; exit 1;;
esac
# each "host" its own directory for shared-memory segments: the namespaces share /dev/shm and the
# host name, by which Open MPI names a node's segments (with the job and local rank), so two nodes'
# segments would collide
mkdir -p "/dev/shm/$ns"
exec env OMPI_MCA_btl_vader_backing_directory="/dev/shm/$ns" ip netns exec "$ns" /bin/sh -c "$*"
"""


def mpirun_command(
    tmp: Path,
    yield_when_idle: int = 1,
    n: int | None = None,
    env: dict | None = None,
    ranks_per_node: int = 1,
    intra: str = "tcp",
) -> list[str]:
    """``ip netns exec <head> mpirun ...`` for ``n`` (default N_WORKERS) worker namespaces, with
    the agent and hostfile written to ``tmp``; append the program and its arguments.
    ``ranks_per_node`` G: each namespace is a node of G consecutive ranks (``slots=G``,
    ``--map-by slot``: Open MPI's local size, so ``hvd.local_size()``, is G, and
    ``HOROVOD_ALQ_LOCAL_SIZE=G`` is exported for the DDP rows); their TCP between each other goes to
    the namespace's own address, i.e. over its loopback, unshaped and not counted on eth0. G = 1
    (the default): one rank per namespace, every link between ranks shaped.
    ``env``: more variables exported to the ranks."""
    n = N_WORKERS if n is None else n
    g = int(ranks_per_node)
    cases = "\n".join(f"  {SUBNET}.{i + 1}) ns={PREFIX}-w{i};;" for i in range(n))
    agent = tmp / "netns_agent.sh"
    agent.write_text(AGENT.format(cases=cases))
    agent.chmod(0o755)
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{SUBNET}.{i + 1} slots={g}\n" for i in range(n)))
    env_vars = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HOROVOD_CPU_OPERATIONS": "mpi",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(ROOT),
        **({"HOROVOD_ALQ_LOCAL_SIZE": str(g)} if g > 1 else {}),
        **(env or {}),
    }
    cmd = [
        "mpirun",
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "-np",
        str(n * g),
        "--hostfile",
        str(hostfile),
        "--map-by",
        "slot" if g > 1 else "node",
        "--mca",
        "plm_rsh_agent",
        str(agent),
        "--mca",
        "plm_rsh_no_tree_spawn",
        "1",
        "--mca",
        "btl",
        "self,vader,tcp" if intra == "shm" and g > 1 else "self,tcp",
        # no single-copy (CMA) between the namespaces' processes: plain copies through the segment
        *(("--mca", "btl_vader_single_copy_mechanism", "none") if intra == "shm" and g > 1 else ()),
        "--mca",
        "btl_tcp_if_include",
        f"{SUBNET}.0/24",
        "--mca",
        "oob_tcp_if_include",
        f"{SUBNET}.0/24",
        # orteds stay attached to the agent instead of daemonizing (Open MPI's default with this
        # agent: the agent returns at once and the daemon's messages go to /dev/null); attached,
        # they reach the log. A daemon that never connects back still leaves mpirun waiting
        # forever (orte_startup_timeout 0, also after an agent that exits 0): launch() bounds that
        "--mca",
        "orte_leave_session_attached",
        "1",
        # every namespace is a "host" of its own, so Open MPI never sees that all ranks share these
        # cores, and its waits spin on the cores the other ranks need unless told to yield
        "--mca",
        "mpi_yield_when_idle",
        str(yield_when_idle),
        # no shared-memory copy of the node's topology: Open MPI 4.1.4's orted segfaulted in
        # hwloc_shmem_topology_write at start-up in 2 of about 10 launches here (mpirun then exits 139)
        "--mca",
        "rtc_hwloc_vmhole",
        "none",
    ]
    for k, v in env_vars.items():
        cmd += ["-x", f"{k}={v}"]
    return ["ip", "netns", "exec", f"{PREFIX}-head", *cmd]


def link_counters(n: int | None = None) -> list[tuple[int, int]]:
    """(tx_bytes, rx_bytes) of eth0 of each of the first ``n`` (default N_WORKERS) worker
    namespaces, from ``ip -n <ns> -s -j link show eth0`` (whole frames: Ethernet, IP and TCP
    headers included)."""
    out = []
    for i in range(N_WORKERS if n is None else n):
        st = json.loads(sh(f"ip -n {PREFIX}-w{i} -s -j link show eth0").stdout)[0]["stats64"]
        out.append((int(st["tx"]["bytes"]), int(st["rx"]["bytes"])))
    return out


class LaunchTimeout(RuntimeError):
    """A launch whose ranks did not all start within the connect timeout."""


CONNECT_TIMEOUT = 60.0  # seconds for every node's orted to connect back and start its ranks


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(comm, ppid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    return comm, int(text[text.rindex(")") + 2 :].split()[1])


def missing_ranks(n: int, ranks_per_node: int = 1) -> list[tuple[str, str | None]]:
    """(namespace, None when its ``ranks_per_node`` ranks run, else what runs there) for each of
    the first ``n`` worker namespaces: a rank is a child of an ``orted``, which mpirun starts
    through the agent, and launches ranks on only after every orted has connected back to it."""
    missing = []
    for i in range(n):
        ns = f"{PREFIX}-w{i}"
        pids = sh(f"ip netns pids {ns}", check=False).stdout.split()
        stats = {pid: _proc_stat(pid) for pid in pids}
        orteds = {pid for pid, st in stats.items() if st and st[0] == "orted"}
        ranks = sum(1 for st in stats.values() if st and str(st[1]) in orteds)
        if ranks < ranks_per_node:
            what = (
                f"{len(orteds)} orted, {ranks} of {ranks_per_node} ranks"
                if orteds
                else "no orted (the agent never started one, or it exited)"
            )
            missing.append((ns, f"worker {i} ({SUBNET}.{i + 1}, namespace {ns}): {what}"))
        else:
            missing.append((ns, None))
    return missing


def launch(
    full: list[str],
    log: Path,
    timeout: float,
    missing=None,
    connect_timeout: float = CONNECT_TIMEOUT,
    poll: float = 1.0,
    cleanup=None,
) -> int:
    """Run a :func:`mpirun_command` line from the repository root, output to ``log``; its exit status.
    ``missing``: a callable returning (key, None if started else a description) for each part of
    the launch (e.g. ``lambda: missing_ranks(n, g)``; a key once started stays started); while
    anything is missing after ``connect_timeout`` seconds, mpirun's process group is killed,
    ``cleanup()`` called (e.g. :func:`kill_in_namespaces`; the namespaces stay, for a retry) and
    :class:`LaunchTimeout` names what was missing. Past ``timeout``: the same kill, and
    ``subprocess.TimeoutExpired``."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            full,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )

        def kill() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if cleanup is not None:
                cleanup()

        try:
            waiting, started = missing is not None, set()
            while True:
                try:
                    return proc.wait(timeout=poll)
                except subprocess.TimeoutExpired:
                    pass
                elapsed = time.monotonic() - start
                if waiting:
                    now = missing()
                    started |= {key for key, text in now if text is None}
                    left = [(key, text) for key, text in now if key not in started]
                    if not left:
                        waiting = False
                    elif elapsed > connect_timeout:
                        kill()
                        raise LaunchTimeout(
                            f"launch not started after {connect_timeout:g} s: "
                            + "; ".join(text for _, text in left)
                            + " (mpirun starts the ranks only once every orted has connected back to it: a "
                            f"worker without an orted holds up the others; mpirun killed; its output: {log})"
                        )
                if elapsed > timeout:
                    kill()
                    raise subprocess.TimeoutExpired(full, timeout)
        except BaseException:
            if proc.poll() is None:
                kill()
            raise


def launch_retry(
    full: list[str],
    log: Path,
    timeout: float,
    missing=None,
    connect_timeout: float = CONNECT_TIMEOUT,
    tries: int = 2,
    say=print,
    cleanup=None,
) -> int:
    """:func:`launch`, tried again (once, by default) after a :class:`LaunchTimeout`; the last one raised."""
    for attempt in range(1, tries + 1):
        try:
            return launch(full, log, timeout, missing, connect_timeout, cleanup=cleanup)
        except LaunchTimeout as e:
            if attempt == tries:
                raise LaunchTimeout(f"{e} (try {attempt} of {tries})") from None
            say(f"{e}; retrying ({attempt + 1} of {tries})", flush=True)
    raise AssertionError("unreachable")


def run_workers(args, tmp: Path, rate_label: str) -> dict:
    out = tmp / f"result_{rate_label}.json"
    full = mpirun_command(tmp, args.yield_when_idle) + [
        sys.executable,
        "-m",
        "scripts.bench.network",
        "--worker",
        "--worker-out",
        str(out),
        "--methods",
        args.methods,
        "--hidden",
        str(args.hidden),
        "--batch-size",
        str(args.batch_size),
        "--bits",
        str(args.bits),
        "--bucket-size",
        str(args.bucket_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    print(f"[{rate_label}] {shlex.join(full)}", flush=True)
    log = tmp / f"mpirun_{rate_label}.log"
    rc = launch_retry(full, log, args.timeout, missing=lambda: missing_ranks(N_WORKERS), cleanup=kill_in_namespaces)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"mpirun failed ({rc}):\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------- driver
def wire_bits(method: str, bits: float, bucket: int, n: int) -> float:
    """Bits each worker receives per coordinate (docs: Horovod wire arithmetic; ``bits="auto"``:
    ``bits`` is the budget, the most the allocation spends)."""
    if method == "none":
        return 2 * (n - 1) / n * 32
    if method == "fp16":
        return 2 * (n - 1) / n * 16
    if method.endswith("-2p"):  # scatter-reduce + allgather of codes (horovod_alq/exchange/two_phase.py)
        return 2 * (n - 1) / n * (bits + 32 / bucket)
    return (n - 1) * (bits + 32 / bucket)


def _bits(method: str, args) -> float:
    return args.bit_budget if "auto" in method else args.bits


def report(runs: dict, args, argv, throughput: dict, wall: float) -> str:
    rates = list(runs)
    params = next(iter(next(iter(runs.values()))["results"].values()))["params"]
    lines = [
        f"Command: `python -m scripts.bench.network {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({wall:.0f} s in all).",
        "",
        f"{N_WORKERS} workers in network namespaces, MLP 784-{args.hidden}-{args.hidden}-10 "
        f"({params / 1e6:.1f}M parameters), "
        f"batch {args.batch_size} per worker, {args.bits} bits, bucket {args.bucket_size}; median over "
        f"{args.steps} timed steps (after {args.warmup} warm-up) of the slowest rank's step time; "
        f"Open MPI mpi_yield_when_idle={args.yield_when_idle}.",
        "",
        "| link | measured TCP throughput w0->w1 | "
        + " | ".join(LABELS.get(m, m) for m in args.methods.split(","))
        + " | fwd+bwd incl. compress calls (max over methods) |",
        "|---|---|" + "---|" * (len(args.methods.split(",")) + 1),
    ]
    for rate in rates:
        res = runs[rate]["results"]
        base = res.get("none", {}).get("step_s")
        cells = []
        for m in args.methods.split(","):
            s = res[m]["step_s"]
            cells.append(f"{s * 1e3:.0f} ms" + (f" ({s / base:.2f}x)" if base else ""))
        comp = max(r["compute_s"] for r in res.values())
        lines.append(
            f"| {rate} | {throughput.get(rate, float('nan')) * 8 / 1e6:.0f} Mbit/s | "
            + " | ".join(cells)
            + f" | {comp * 1e3:.0f} ms |"
        )
    lines += [
        "",
        "Ratios in parentheses are to none (fp32) on the same link. Wire arithmetic per worker "
        "and coordinate: "
        + ", ".join(
            f"{LABELS.get(m, m)} {wire_bits(m, _bits(m, args), args.bucket_size, N_WORKERS):.2f} bits"
            for m in args.methods.split(",")
        )
        + ".",
    ]
    methods = args.methods.split(",")
    if "fp16" in methods:
        others = [m for m in methods if m != "fp16"]
        lines += [
            "",
            "Step time as a fraction of fp16's on the same link (below 1: faster than fp16):",
            "",
            "| link | " + " | ".join(f"{LABELS.get(m, m)} / fp16" for m in others) + " |",
            "|---|" + "---|" * len(others),
        ]
        for rate in rates:
            res = runs[rate]["results"]
            lines.append(
                f"| {rate} | " + " | ".join(f"{res[m]['step_s'] / res['fp16']['step_s']:.2f}" for m in others) + " |"
            )
    measured = [m for m in methods if "bytes_received_per_step" in next(iter(runs.values()))["results"][m]]
    if measured:
        res = runs[rates[0]]["results"]
        lines += [
            "",
            f"Payload bytes per step and rank, measured by the compressors (rank 0, {rates[0]} run; the "
            "same on every link), against the wire arithmetic above times the parameter count:",
            "",
            "| method | exchange | sent | received | arithmetic (received) |",
            "|---|---|---|---|---|",
        ]
        for m in measured:
            r = res[m]
            lines.append(
                f"| {LABELS.get(m, m)} | {r['exchange']} | {r['bytes_sent_per_step'] / 1e6:.2f} MB | "
                f"{r['bytes_received_per_step'] / 1e6:.2f} MB | "
                f"{wire_bits(m, _bits(m, args), args.bucket_size, N_WORKERS) * params / 8e6:.2f} MB |"
            )
        lines.append(
            f"| {LABELS['none']} | ring allreduce (arithmetic) | | | "
            f"{wire_bits('none', args.bits, args.bucket_size, N_WORKERS) * params / 8e6:.2f} MB |"
        )
        lines.append(
            f"| fp16 | ring allreduce (arithmetic) | | | "
            f"{wire_bits('fp16', args.bits, args.bucket_size, N_WORKERS) * params / 8e6:.2f} MB |"
        )
        for m in measured:
            if res[m].get("allocation"):
                lines += [
                    "",
                    f"{LABELS.get(m, m)}: widths {res[m]['allocation']} of the compressed tensors in "
                    f"round order (the last layer first), {res[m]['allocated_mean_bits']:.2f} bits per "
                    f"coordinate (budget {args.bit_budget}); "
                    "the bytes above average every step, the first one (all at the default "
                    f"{int(args.bit_budget)} bits, before the allocation) included.",
                ]
    return "\n".join(lines) + "\n"


def plot(runs: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = args.methods.split(",")
    rates = list(runs)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [runs[r]["results"][m]["step_s"] for r in rates]
        xs = np.arange(len(rates)) + (j - (len(methods) - 1) / 2) * w
        ax.bar(xs, vals, w, label=LABELS.get(m, m))
    ax.set_xticks(np.arange(len(rates)), rates)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step (median, slowest rank)")
    ax.set_title(f"{N_WORKERS} workers in netns, tc tbf per worker link, MLP {args.hidden}x{args.hidden}")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def preflight(script: str, teardown_only: bool, hint: str = "") -> int | None:
    """Before any namespace is made: root, ``--teardown-only``, namespaces left by another run, and
    SIGTERM / SIGHUP raised as KeyboardInterrupt (so the caller's cleanup tears the namespaces
    down). Returns an exit status to stop with, or None to go on."""
    if os.geteuid() != 0:
        print(f"{script} needs root (ip netns, tc){hint}", file=sys.stderr)
        return 2
    if teardown_only:
        left = teardown()
        print("left:", left)
        return 1 if left else 0
    if existing_namespaces():
        print(
            f"namespaces {existing_namespaces()} exist (another run, or a killed one?); remove with --teardown-only",
            file=sys.stderr,
        )
        return 2

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="unshaped,1gbit,100mbit", help="tc tbf rates; 'unshaped' = no qdisc")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workers", type=int, default=4, help="worker namespaces and ranks, 2..8; default 4")
    p.add_argument("--hidden", type=int, default=4096, help="MLP width; default 4096 (20.0M parameters)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=8192)
    p.add_argument("--bit-budget", type=float, default=2.5, help="of the alq-auto methods; default 2.5")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mpirun")
    p.add_argument(
        "--yield-when-idle",
        type=int,
        choices=(0, 1),
        default=1,
        help="Open MPI's mpi_yield_when_idle for the ranks; default 1 (the ranks share this "
        "machine's cores; 0: busy-wait, what the runs before 2026-12-01 did)",
    )
    p.add_argument("--out-dir", default="docs/results")
    p.add_argument(
        "--tag",
        default="",
        help="suffix of the output file names (bench_network<tag>.md/.png, data/bench_network<tag>.json)",
    )
    p.add_argument("--quick", action="store_true", help="1gbit only, MLP 512, 2 steps")
    p.add_argument("--teardown-only", action="store_true", help="remove leftover namespaces of this script")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    global N_WORKERS
    if not 2 <= args.workers <= 8:
        p.error("--workers must be 2..8")
    N_WORKERS = args.workers
    if args.quick:
        args.rates, args.hidden, args.steps, args.warmup = "1gbit", 512, 2, 1
    status = preflight("scripts.bench.network", args.teardown_only)
    if status is not None:
        return status
    out_dir = Path(args.out_dir)
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    runs, throughput = {}, {}
    try:
        with tempfile.TemporaryDirectory(prefix="alqnet-") as tmp:
            setup()
            for rate in args.rates.split(","):
                shape(None if rate == "unshaped" else rate)
                throughput[rate] = measure_throughput()
                print(f"[{rate}] TCP throughput w0->w1: {throughput[rate] * 8 / 1e6:.0f} Mbit/s", flush=True)
                runs[rate] = run_workers(args, Path(tmp), rate)
                print(json.dumps({m: round(r["step_s"], 4) for m, r in runs[rate]["results"].items()}), flush=True)
    finally:
        left = teardown()
        print("teardown:", "all namespaces removed" if not left else f"LEFT {left}", flush=True)
    wall = time.monotonic() - start
    text = report(runs, args, argv, throughput, wall)
    (out_dir / f"bench_network{args.tag}.md").write_text(text)
    (out_dir / "data" / f"bench_network{args.tag}.json").write_text(
        json.dumps({"args": vars(args), "throughput_Bps": throughput, "runs": runs}, indent=1)
    )
    plot(runs, args, out_dir / f"bench_network{args.tag}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
