"""Start a command as K "nodes" of G ranks on this host: K torchrun agents, each ``--nnodes K
--nproc-per-node G --node-rank k`` with a static rendezvous on a free loopback port, as a job across
K machines would be started (each agent sets its ranks' ``LOCAL_WORLD_SIZE = G``).

Usage (a launcher prefix for :func:`multiproc.run_ranks`)::

    python torchrun_nodes.py K G COMMAND [ARGS...]

Exits with the first non-zero exit status of an agent (the others are then stopped), else 0.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    nodes, per_node, command = int(argv[0]), int(argv[1]), argv[2:]
    torchrun = Path(sys.executable).parent / "torchrun"
    port = free_port()
    agents = [
        subprocess.Popen(
            [str(torchrun), "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--node-rank", str(k)]
            + ["--master-addr", "127.0.0.1", "--master-port", str(port), "--no-python", *command]
        )
        for k in range(nodes)
    ]
    status = 0
    while any(a.poll() is None for a in agents):
        failed = [a.returncode for a in agents if a.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            for a in agents:
                if a.poll() is None:
                    a.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    for a in agents:
        a.wait()
    return status or next((a.returncode for a in agents if a.returncode), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
