"""``python -m redis_locks_async``: the command line (see :mod:`redis_locks_async.cli`)."""

import sys

from .cli import main

sys.exit(main())
