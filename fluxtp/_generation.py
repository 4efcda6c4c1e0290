"""Every cache of plans resolved per call signature (fluxtp.ops' call plans, the fused launchers'
plans), and bump(): something such a cache resolved may have changed, and every cache drops its
plans then; each is rebuilt at its next call.

Bumped by: fluxtp.configs.reload() (new tuning tables), fluxtp.symm when a symmetric buffer is
created, grown or freed, a fused launcher when it replaces a workspace, and
fluxtp._dist.destroy_process_group (groups gone). Rare events all: a plan is rebuilt once after.
"""

import weakref

caches: weakref.WeakSet = weakref.WeakSet()  # every cache of plans (fluxtp._plan.PlanCache)


def bump() -> None:
    """Every cached plan is stale: each cache drops its plans now, so that what only stale plans
    hold (a replaced workspace) is freed here, outside any CUDA graph capture (buffers are
    replaced outside one), not at a later call that may be captured (CUDA refuses to unmap
    memory during a capture, and the process aborts)."""
    for cache in list(caches):
        cache.clear()
