"""Entering and leaving the sequence-parallel region, and replicated parameters used inside it.

Inside the region every rank holds a contiguous block of rows of the activations flattened
to [tokens, hidden] (see fluxtp.nn.linear). Three pieces make a model exact there:

- `scatter_tokens(x)`: full activations, identical on every rank -> this rank's rows. The
  backward all-gathers the row gradients, so every rank gets the full, identical gradient.
- `gather_tokens(x_shard)`: rows -> full activations, for a *replicated* consumer (an LM head
  and loss computed identically on every rank). Its gradient is then identical on every rank,
  so the backward keeps this rank's rows (no reduction: summing would count it W times).
- `sum_grads_over_group(module)`: a module with replicated parameters that runs on row shards
  (a norm, a whole-bias) sees only its own rows, so each rank's parameter gradient is a
  partial sum; this sums it over the group in the backward, before it is accumulated into
  `.grad` (so gradient accumulation, DDP and FSDP2 all see the full gradient).

Each takes a `backend` (as the parallel linears do) that its communication runs through
(fluxtp.nn._collectives); the hooks of sum_grads_over_group list themselves for set_backend.
"""

from __future__ import annotations

import torch
from torch import nn

from fluxtp._dist import GroupInfo, resolve_group
from fluxtp.nn._collectives import all_reduce_sum, gather_rows, rows_block
from fluxtp.ops._validate import check_backend


def _check_rows(rows: int, world: int, what: str) -> None:
    if rows % world:
        raise ValueError(
            f"{what} has {rows} tokens (rows of the flattened [tokens, hidden] activations), which the "
            f"tensor-parallel world size {world} does not divide; sequence parallelism needs batch*seq % {world} == 0"
        )


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_rows, info: GroupInfo, backend: str):
        ctx.info, ctx.backend = info, backend
        return rows_block(x_rows, info).clone()  # a copy: the full tensor may be freed

    @staticmethod
    def backward(ctx, grad_shard):
        return gather_rows(grad_shard, ctx.info, ctx.backend), None, None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, info: GroupInfo, backend: str):
        ctx.info = info
        return gather_rows(x_shard, info, backend)

    @staticmethod
    def backward(ctx, grad_rows):
        return rows_block(grad_rows, ctx.info).contiguous(), None, None


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, t, info: GroupInfo, backend: str):
        ctx.info, ctx.backend = info, backend
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd may still hold `grad`; reduce our own copy
        all_reduce_sum(grad, ctx.info, ctx.backend)
        return grad, None, None


def scatter_tokens(x: torch.Tensor, group=None, *, backend: str = "auto") -> torch.Tensor:
    """x [..., hidden] (full, identical on every rank) -> this rank's rows [tokens/W, hidden].

    Rank r gets rows r*T/W .. (r+1)*T/W - 1 of x flattened to [T, hidden]. ValueError when the
    group size does not divide T. The backward's gather runs through `backend`.
    """
    check_backend(backend)
    info = resolve_group(group)
    x_rows = x.reshape(-1, x.shape[-1])
    _check_rows(x_rows.shape[0], info.world_size, f"x of shape {tuple(x.shape)}")
    if info.world_size == 1:
        return x_rows
    return _ScatterTokens.apply(x_rows, info, backend)


def gather_tokens(x_shard: torch.Tensor, group=None, *, backend: str = "auto") -> torch.Tensor:
    """x_shard [tokens/W, hidden] -> [tokens, hidden], for consumers replicated on every rank.

    The gather runs through `backend`; the backward keeps this rank's rows of the (identical)
    gradient. Reshape the result to [batch, seq, hidden] yourself.
    """
    check_backend(backend)
    info = resolve_group(group)
    if x_shard.dim() != 2:
        raise ValueError(f"x_shard must be [tokens/W, hidden], got shape {tuple(x_shard.shape)}")
    if info.world_size == 1:
        return x_shard
    return _GatherTokens.apply(x_shard, info, backend)


def track_backend(module: nn.Module, hooks) -> None:
    """List `hooks` (an object whose `backend` attribute its hooks read) on `module`, where
    set_backend (fluxtp.nn.decoder) finds it."""
    module._fluxtp_hooks = [*getattr(module, "_fluxtp_hooks", ()), hooks]


class _GradSumHooks:
    """Forward pre-hook + forward hook: while the module runs, each of its own parameters is
    replaced by an identity view whose backward sums the gradient over the group (through
    `backend`); the parameter itself stays registered (same names, optimizer state, FSDP2/DDP
    handling)."""

    def __init__(self, info: GroupInfo, backend: str):
        self.info, self.backend = info, backend
        self.saved: dict[str, nn.Parameter] = {}

    def before(self, module: nn.Module, args):
        self.saved = {name: p for name, p in module._parameters.items() if p is not None}
        for name, p in self.saved.items():
            if p.requires_grad and torch.is_grad_enabled():
                module._parameters[name] = _SumGradOverGroup.apply(p, self.info, self.backend)

    def after(self, module: nn.Module, args, output):
        module._parameters.update(self.saved)
        self.saved = {}


def sum_grads_over_group(module: nn.Module, group=None, *, backend: str = "auto") -> nn.Module:
    """Make `module`'s own (non-recursive) parameters' gradients sum over `group`, through `backend`.

    For replicated parameters used on row shards (norm weights and biases in the
    sequence-parallel region). Returns the module, changed in place; a world of one is left as is.
    """
    check_backend(backend)
    info = resolve_group(group)
    if info.world_size == 1:
        return module
    if getattr(module, "_fluxtp_grad_sum_group", None) is not None:
        # Twice would sum twice (W times the gradient): refuse rather than double count.
        raise ValueError(f"{type(module).__name__} already has its gradients summed over a group")
    hooks = _GradSumHooks(info, backend)
    module.register_forward_pre_hook(hooks.before)
    # always_call: restore the real parameters even when the forward raises.
    module.register_forward_hook(hooks.after, always_call=True)
    module._fluxtp_grad_sum_group = info.name
    track_backend(module, hooks)
    return module
