"""Settings for the whole test session.

The CPU suite spawns gloo worlds of 2-3 processes on machines with as few as 2 cores. With the
default of one OpenMP thread per core in every rank, the ranks oversubscribe the cores and
every collective waits on descheduled threads (torchrun picks 1 thread for the same reason).
Set here, before any rank is spawned: the children inherit it; a caller's own value wins."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
