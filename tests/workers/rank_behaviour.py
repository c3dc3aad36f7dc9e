"""Worker for the tests of run_ranks itself (no Horovod): report, fail, stay silent or hang.

Usage: rank_behaviour.py MODE [RANK [TAG]]; MODE is applied on RANK ("all", the default: every
rank), the other ranks report normally. TAG is ignored (it marks the processes for a test). Modes:
ok, fail (print a marker and exit 3), silent (exit 0 without reporting), hang (sleep forever).
"""

import sys
import time

from common import launcher_rank, report

mode = sys.argv[1]
target = sys.argv[2] if len(sys.argv) > 2 else "all"
rank = launcher_rank()
if target == "all" or int(target) == rank:
    if mode == "fail":
        print(f"rank {rank} says: deliberate failure marker")
        sys.exit(3)
    if mode == "silent":
        sys.exit(0)
    if mode == "hang":
        print(f"rank {rank} hangs", flush=True)
        time.sleep(3600)
report({"rank": rank, "argv": sys.argv[1:]})
