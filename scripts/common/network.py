"""Network namespaces joined by tc-shaped links, and mpirun across them (needs root): worker
namespaces alqnet-w<i> (10.213.0.<i+1>, shaped both ways), alqnet-head (mpirun, unshaped) and a
bridge alqnet-br; torn down also on failure, Ctrl-C or SIGTERM once :func:`preflight` ran. With
``ranks_per_node=G``, G consecutive ranks share a namespace and its unshaped loopback. Used by
scripts/bench/network.py, train_step.py, fsdp.py and scripts/study/time_to_accuracy.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import launch as launching

ROOT = Path(__file__).resolve().parents[2]
# One cluster per prefix on a machine (sweep() holds a lock on it); a second run beside the first
# sets both variables, for example ALQNET_PREFIX=alqnet2 ALQNET_SUBNET=10.214.0.
PREFIX = os.environ.get("ALQNET_PREFIX", "alqnet")
SUBNET = os.environ.get("ALQNET_SUBNET", "10.213.0")


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


def setup(n: int) -> None:
    """The bridge, the head and ``n`` worker namespaces."""
    br = f"{PREFIX}-br"
    sh(f"ip netns add {br}")
    sh(f"ip -n {br} link set lo up")
    sh(f"ip -n {br} link add br0 type bridge")
    sh(f"ip -n {br} link set br0 up")
    hosts = [(f"{PREFIX}-w{i}", f"{SUBNET}.{i + 1}", f"p{i}") for i in range(n)]
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


def shape(rate: str | None, n: int) -> None:
    """tbf on both ends of every worker link (never the head's link, whose traffic is control only);
    ``n``: the first n workers."""
    br = f"{PREFIX}-br"
    for i in range(n):
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
    n: int = 4,
    env: dict | None = None,
    ranks_per_node: int = 1,
    intra: str = "tcp",
) -> list[str]:
    """``ip netns exec <head> mpirun ...`` over ``n`` worker namespaces (agent and hostfile in
    ``tmp``), ``ranks_per_node`` consecutive ranks per namespace (also exported as
    HOROVOD_ALQ_LOCAL_SIZE), ``env`` exported; append the program."""
    g = int(ranks_per_node)
    cases = "\n".join(f"  {SUBNET}.{i + 1}) ns={PREFIX}-w{i};;" for i in range(n))
    agent = tmp / "netns_agent.sh"
    agent.write_text(AGENT.format(cases=cases))
    agent.chmod(0o755)
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{SUBNET}.{i + 1} slots={g}\n" for i in range(n)))
    env_vars = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HOROVOD_CPU_OPERATIONS": "mpi"}
    env_vars.update(
        PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), **({"HOROVOD_ALQ_LOCAL_SIZE": str(g)} if g > 1 else {})
    )
    env_vars["HOROVOD_ALQ_COMPRESS"] = launching.RANK_ENV["HOROVOD_ALQ_COMPRESS"]  # studies: compress="always"
    if "HOROVOD_CYCLE_TIME" in os.environ:  # Horovod's coordination cycle (ms), passed on when set
        env_vars["HOROVOD_CYCLE_TIME"] = os.environ["HOROVOD_CYCLE_TIME"]
    shm = intra == "shm" and g > 1
    mca = {
        "plm_rsh_agent": str(agent),
        "plm_rsh_no_tree_spawn": "1",
        "btl": "self,vader,tcp" if shm else "self,tcp",
        # no single-copy (CMA) between the namespaces' processes: plain copies through the segment
        **({"btl_vader_single_copy_mechanism": "none"} if shm else {}),
        "btl_tcp_if_include": f"{SUBNET}.0/24",
        "oob_tcp_if_include": f"{SUBNET}.0/24",
        # orteds stay attached to the agent instead of daemonizing (Open MPI's default with this
        # agent: the agent returns at once and the daemon's messages go to /dev/null); attached,
        # they reach the log. A daemon that never connects back still leaves mpirun waiting
        # forever (orte_startup_timeout 0, also after an agent that exits 0): launch() bounds that
        "orte_leave_session_attached": "1",
        # every namespace is a "host" of its own, so Open MPI never sees that all ranks share these
        # cores, and its waits spin on the cores the other ranks need unless told to yield
        "mpi_yield_when_idle": str(yield_when_idle),
        # no shared-memory copy of the node's topology: Open MPI 4.1.4's orted segfaulted in
        # hwloc_shmem_topology_write at start-up in 2 of about 10 launches here (mpirun then exits 139)
        "rtc_hwloc_vmhole": "none",
    }
    cmd = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-np", str(n * g), "--hostfile", str(hostfile)]
    cmd += ["--map-by", "slot" if g > 1 else "node"] + [a for k, v in mca.items() for a in ("--mca", k, v)]
    cmd += [a for k, v in {**env_vars, **(env or {})}.items() for a in ("-x", f"{k}={v}")]
    return ["ip", "netns", "exec", f"{PREFIX}-head", *cmd]


def link_counters(n: int) -> list[tuple[int, int]]:
    """(tx_bytes, rx_bytes) of eth0 of the first ``n`` worker namespaces (whole frames)."""
    out = []
    for i in range(n):
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
    """(namespace, None when its ranks run, else what runs there) for the first ``n`` worker
    namespaces."""
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
    """Run a :func:`mpirun_command` line from the root, output to ``log``; its exit status. While
    ``missing()`` names a part not started after ``connect_timeout`` s: kill, ``cleanup()`` and
    :class:`LaunchTimeout`; past ``timeout``: the same kill and ``subprocess.TimeoutExpired``."""
    start, started, waiting = time.monotonic(), set(), [missing is not None]

    def watch() -> None:
        if not waiting[0]:
            return
        now = missing()
        started.update(key for key, text in now if text is None)
        left = [text for key, text in now if key not in started]
        if not left:
            waiting[0] = False
        elif time.monotonic() - start > connect_timeout:
            raise LaunchTimeout(
                f"launch not started after {connect_timeout:g} s: "
                + "; ".join(left)
                + " (mpirun starts the ranks only once every orted has connected back to it: a "
                f"worker without an orted holds up the others; mpirun killed; its output: {log})"
            )

    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return launching.run(full, log, timeout, env=env, watch=watch, poll=poll, cleanup=cleanup)


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


def preflight(script: str, teardown_only: bool, hint: str = "") -> int | None:
    """Before any namespace: root, ``--teardown-only``, leftovers of another run, SIGTERM/SIGHUP as
    KeyboardInterrupt. An exit status to stop with, or None."""
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


# ---------------------------------------------------------------------------------------- in the ranks
def if_addr(name: str) -> str:
    """IPv4 address of network interface ``name`` (SIOCGIFADDR)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])


def free_port(addr: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def join_gloo(hvd, ifname: str, timeout: float) -> None:
    """torch.distributed (gloo) in the processes Horovod started, over interface ``ifname``: rank 0
    picks its address there and a free port, and Horovod broadcasts them."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    where = None
    if hvd.rank() == 0:
        addr = if_addr(ifname)
        where = (addr, free_port(addr))
    addr, port = hvd.broadcast_object(where, root_rank=0, name="join_gloo.address")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=hvd.rank(),
        world_size=hvd.size(),
        timeout=datetime.timedelta(seconds=timeout),
    )


# ---------------------------------------------------------------------------------------- sweeps
@contextlib.contextmanager
def _cluster_lock():
    """Holds /tmp/<PREFIX>.lock while this process owns the namespaces <PREFIX>-*; RuntimeError,
    naming the way around it, if another run holds it."""
    with open(f"/tmp/{PREFIX}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another run holds the namespaces {PREFIX}-* (/tmp/{PREFIX}.lock); run beside it with "
                "ALQNET_PREFIX and ALQNET_SUBNET set to other values (see scripts/common/network.py)"
            ) from None
        yield


def sweep(local: bool, rates: list[str], nodes: int, prefix: str, each) -> list:
    """``each(tmp, rate, bps)`` per rate, concatenated: on the loopback with ``local`` (rate and bps
    None), else in ``nodes`` namespaces shaped to each rate, ``bps`` measured first."""
    out = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if local:
            return each(Path(tmp), None, None)
        with _cluster_lock():
            try:
                setup(nodes)
                for rate in rates:
                    shape(None if rate == "unshaped" else rate, nodes)
                    bps = measure_throughput()
                    print(f"[{rate}] TCP throughput w0->w1: {bps * 8 / 1e6:.0f} Mbit/s", flush=True)
                    out += each(Path(tmp), rate, bps)
            finally:
                left = teardown()
                print("teardown:", "all namespaces removed" if not left else f"LEFT {left}", flush=True)
    return out


def step_runs(args, workers: list[int], prefix: str, run) -> list[dict]:
    """``run(args, tmp, n, rate)`` per worker (or node) count and rate of ``args.rates``, or on the
    loopback with ``args.local``."""
    rates, g = args.rates.split(","), getattr(args, "ranks_per_node", 1) or 1

    def each(tmp: Path, rate: str | None, bps: float | None) -> list[dict]:
        out = []
        for n in workers:
            result = run(args, tmp, n, rate)
            entry = {"workers": n * g, "rate": rate or "loopback (no namespaces)", "run": result}
            if rate is not None:
                entry.update(throughput_Bps=bps, **({"nodes": n, "ranks_per_node": g} if g > 1 else {}))
                print(json.dumps({k: round(r["step_s"], 4) for k, r in result["results"].items()}), flush=True)
            out.append(entry)
        return out

    runs = sweep(args.local, rates, max(workers), prefix, each)
    return sorted(runs, key=lambda r: (r["workers"], rates.index(r["rate"]) if r["rate"] in rates else 0))


def step_main(p: argparse.ArgumentParser, args, argv, module: str, rows: list[str], run, page, check=None) -> int:
    """A step benchmark's driver (train_step.py's, fsdp.py's) once its options are parsed: --rows and
    --workers checked, --out's default, ``check(args, workers)`` (why not to launch, or None), root,
    :func:`step_runs` of ``run`` and ``page(args, argv, runs, wall)`` with its JSON."""
    from scripts.common import report

    unknown = [r for r in args.rows.split(",") if r not in rows]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {rows}")
    workers = [int(w) for w in args.workers.split(",")]
    if not all(2 <= w <= 8 for w in workers):
        p.error("--nodes must be 2..8" if getattr(args, "nodes", None) else "--workers must be 2..8")
    name = module.rsplit(".", 1)[1]
    if args.out is None:
        args.out = f"build/{'bench' if args.quick else 'results'}/bench_{name}.md"
    problem = None if check is None or args.teardown_only else check(args, workers)
    if problem:
        print(f"{module}: {problem}", file=sys.stderr)
        return 2
    start = time.monotonic()
    if not args.local:
        status = preflight(module, args.teardown_only, "; --local runs without")
        if status is not None:
            return status
    runs = step_runs(args, workers, f"alq{name.split('_')[0]}-", run)
    data = {"args": vars(args), "argv": argv if argv is not None else sys.argv[1:], "runs": runs}
    report.write(Path(args.out), page(args, argv, runs, time.monotonic() - start), data)
    return 0


def _result(rc: int, out: Path, log: Path) -> dict:
    if rc != 0 or not out.exists():
        raise RuntimeError(f"mpirun failed ({rc}):\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


def run_netns(args, tmp: Path, n: int, rate: str, cmd, log: Path, suffix: str = "", env: dict | None = None) -> dict:
    """The worker command ``cmd(out, "eth0")`` on ``n`` nodes of ``args.ranks_per_node`` ranks: its
    JSON, with the launch's node-link bytes as "launch_bytes"; a launch that does not start in
    ``args.connect_timeout`` is killed and tried once more."""
    g = getattr(args, "ranks_per_node", 1) or 1
    out = tmp / f"result_{n}_{rate}{suffix}.json"
    yield_when_idle, intra = getattr(args, "yield_when_idle", 1), getattr(args, "intra_node", "tcp")
    full = mpirun_command(tmp, yield_when_idle, n, env=env, ranks_per_node=g, intra=intra) + cmd(out, "eth0")
    where = f"{n} nodes x {g} ranks" if g > 1 else f"{n} workers"
    print(f"[{where}, {rate}{suffix}] {shlex.join(full)}\n  (output: {log})", flush=True)
    before = link_counters(n)
    connect = getattr(args, "connect_timeout", CONNECT_TIMEOUT)
    missing = lambda: missing_ranks(n, g)
    rc = launch_retry(full, log, args.timeout, missing, connect, cleanup=kill_in_namespaces)
    after = link_counters(n)
    run = _result(rc, out, log)
    run["launch_bytes"] = {
        "tx": sum(a[0] - b[0] for a, b in zip(after, before)),
        "rx": sum(a[1] - b[1] for a, b in zip(after, before)),
    }
    return run


def run_local(args, tmp: Path, n: int, cmd, log: Path, tag: str = "local") -> dict:
    """The same worker command on ``n`` ranks on this host's loopback (no namespaces, no shaping,
    shared memory allowed) and its JSON back."""
    out = tmp / f"result_{n}_{tag}.json"
    env = {**launching.RANK_ENV, "HOROVOD_CPU_OPERATIONS": "mpi", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    full = launching.mpirun(n, env, getattr(args, "yield_when_idle", 1)) + cmd(out, "lo")
    print(f"[{n} workers, loopback] {shlex.join(full)}\n  (output: {log})", flush=True)
    return _result(launch(full, log, args.timeout), out, log)


def log_path(out: str, n: int, rate: str) -> Path:
    """mpirun's output, kept beside the report ``out`` (data/<out stem>_logs/)."""
    folder = Path(out).parent / "data" / f"{Path(out).stem}_logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"mpirun_{n}_{rate}.log"


def add_namespace_options(add) -> None:
    """The options every benchmark through the namespaces shares (``add``: a parser's add_argument):
    ``--local`` and the hidden ones of the worker and of the teardown."""
    add("--local", action="store_true", help="no namespaces or shaping: the ranks on loopback (no root needed)")
    add("--gloo-timeout", type=float, default=600, help=argparse.SUPPRESS)
    add("--teardown-only", action="store_true", help="remove leftover namespaces of scripts.bench.network")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--worker-out", help=argparse.SUPPRESS)
    add("--gloo-ifname", default="eth0", help=argparse.SUPPRESS)


def apply_defaults(args, quick: dict, full: dict) -> None:
    """Options left at None take ``quick``'s value with ``--quick``, else ``full``'s."""
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def add_layout_options(add) -> None:
    """--nodes, --ranks-per-node and --layout (``add``: a parser's add_argument); :func:`parse_layout`
    reads them."""
    add("--nodes", help="node counts (2..8), each a namespace of --ranks-per-node ranks (instead of --workers)")
    add("--ranks-per-node", type=int, help="ranks in each node's namespace; default 2 with --nodes")
    add("--layout", help="KxG[,KxG]: --nodes K --ranks-per-node G in one (one G for all)")


def parse_layout(p: argparse.ArgumentParser, args) -> None:
    """--layout into --nodes and --ranks-per-node; --nodes into the namespaces; ranks_per_node 1 without
    (the step benchmarks' options: train_step.py)."""
    if args.layout:
        if args.nodes or args.ranks_per_node:
            p.error("--layout replaces --nodes and --ranks-per-node")
        try:
            pairs = [tuple(int(v) for v in item.lower().split("x")) for item in args.layout.split(",")]
            assert all(len(pair) == 2 for pair in pairs)
        except (ValueError, AssertionError):
            p.error(f"--layout {args.layout!r}: expected KxG[,KxG], e.g. 2x2,4x2")
        if len({g for _, g in pairs}) != 1:
            p.error("--layout: one ranks-per-node G for all layouts")
        args.nodes, args.ranks_per_node = ",".join(str(k) for k, _ in pairs), pairs[0][1]
    if args.nodes:
        if args.ranks_per_node is None:
            args.ranks_per_node = 2
        if args.local:
            p.error("--nodes needs the namespaces (not --local)")
        args.workers = args.nodes  # the namespaces; ranks = nodes x ranks_per_node
    elif args.ranks_per_node not in (None, 1):
        p.error("--ranks-per-node needs --nodes")
    else:
        args.ranks_per_node = 1
    if args.ranks_per_node < 1:
        p.error("--ranks-per-node must be at least 1")
