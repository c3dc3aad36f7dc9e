"""``horovodrun`` for the tests (tests/multiproc.py's "gloo" launcher and its elastic mode): Horovod's
own launcher, ``horovod.runner.launch``, less its check that Horovod was built with Gloo.

That check (``horovod.common.util.gloo_built``) forks a process that imports ``horovod.tensorflow``,
TensorFlow with it, before any rank starts: about 4.5 of the 4.8 CPU-seconds, and most of the wall
time, of a 2-rank ``horovodrun --gloo`` of ``python -c pass`` on a 2-core host (8.3-9.1 s wall at
load 8, 0.9 s with the check answered). Every test that launches this way needs Horovod with Gloo
and is told without the check: tests/test_horovod_runtime.py asserts ``gloo_enabled()`` on each
rank of such a launch.

Usage: ``python tests/horovodrun.py ARGS`` for ``horovodrun ARGS``.
"""

import sys

if __name__ == "__main__":  # (horovodrun starts processes that import the main module again)
    from horovod.runner import launch

    launch.gloo_built = lambda verbose=False: True
    sys.exit(launch.run_commandline())
