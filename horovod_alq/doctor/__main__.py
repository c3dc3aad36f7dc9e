"""``python -m horovod_alq.doctor``: see :mod:`horovod_alq.doctor`."""

import sys

from . import main

sys.exit(main())
