"""One counter for everything cached per call signature (fluxtp.ops' call plans, the fused
launchers' plans): it changes whenever something such a cache resolved may have changed, and a
cached plan built under another value is rebuilt at its next call.

Bumped by: fluxtp.configs.reload() (new tuning tables), fluxtp.symm when a symmetric buffer is
created, grown or freed, a fused launcher when it replaces a workspace, and
fluxtp._dist.destroy_process_group (groups gone). Rare events all: a plan is rebuilt once after.
"""

value = 0


def bump() -> None:
    global value
    value += 1
