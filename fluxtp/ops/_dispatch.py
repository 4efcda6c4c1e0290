"""When an op may call its backend directly instead of through its torch.library custom op.

The custom op is what torch.compile, export, fake-tensor tracing and opcheck see: an opaque op
with a fake implementation. In plain eager code its dispatch only costs host time (about 20 us a
call on a 2-core CPU host; the fused ops are host-bound below a few thousand tokens on the GPU
hosts, docs/perf-log.md). Every backend computes the same thing either way, so an op goes direct
when nothing could tell the difference: nothing compiling or tracing, no dispatch mode active,
plain tensors, and no autograd graph to record (the custom ops register no autograd formula, so
outside the nn layers' autograd.Functions a backward through them must keep failing loudly
rather than silently miss a gradient).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*tensors) -> bool:
    """Whether the op may skip its custom op's dispatch for these arguments (None ones ignored)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) in _PLAIN and not (grad and t.requires_grad)) for t in tensors)
