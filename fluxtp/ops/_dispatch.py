"""How an op reaches its backend: straight to a cached call plan, or through its torch.library
custom op.

The custom op is what torch.compile, export, fake-tensor tracing, opcheck and autograd see: an
opaque op with a fake implementation and an autograd formula (fluxtp.ops._autograd). In plain
eager code its dispatch only costs host time, so an op goes direct when nothing could tell the
difference: nothing compiling or tracing, no dispatch mode active, plain tensors, and no
autograd graph to record (a call that records one goes through the custom op, whose registered
backward computes the gradients).

Direct calls are planned (fluxtp._plan): the first call of a signature (the tensors' type,
dtype, device, shape, strides and alignment, the group, backend and options) validates,
resolves the group and the backend ("auto" included) and asks the backend for its plan; later
calls of the signature go straight to that plan. Validation is part of the first call only: the
signature fixes everything it checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*tensors) -> bool:
    """Whether the op may skip its custom op's dispatch for these arguments (None ones ignored)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop, not all(generator): this runs on every call, and costs half as much
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def records_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None ones ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def group_key(group):
    """The group a plan is keyed by: the world's current group object for None (a new
    init_process_group makes a new one, so a plan never outlives the world it was built for)."""
    if group is None:
        return dist.GroupMember.WORLD if dist.is_available() else None
    return group
