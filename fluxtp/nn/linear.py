"""Column- and row-parallel linears of Megatron-style tensor + sequence parallelism, with the
communication of the forward *and* the backward overlapped by the fused ops.

Sequence-parallel layout (the convention of every module in fluxtp.nn): activations between
blocks are sharded by rows. The rows are the tokens of the activations flattened to
[tokens, hidden]; with W ranks, rank r holds the contiguous block of rows
r*T/W .. (r+1)*T/W - 1 (for [batch, seq, hidden] flattened batch-major, a block may span
several sequences). A tensor of more than two dims is sharded along its first dim, so a shard
[d0, d1, ..., hidden] stands for the full [W*d0, d1, ..., hidden].

    ColumnParallelLinear   x_shard [T/W, K]  --all_gather_matmul-->      y      [T, N/W]
    RowParallelLinear      x       [T, K/W]  --matmul_reduce_scatter-->  out    [T/W, N]
    column_parallel_linears(x_shard, [q, k, v]): several column layers, one all-gather

Backward (what each autograd function computes; G_* are gradients):
    column: G_x_shard = reduce_scatter(G_y @ W_shard)        matmul_reduce_scatter(G_y, W_shard^T)
            G_W_shard = G_y^T @ x_gathered                   (x_gathered kept from the forward,
                                                              or re-gathered with save_memory)
    row:    G_x       = all_gather(G_out_shard) @ W_shard    all_gather_matmul(G_out, W_shard^T),
            G_W_shard = all_gather(G_out_shard)^T @ x         whose gathered G_out serves G_W too
            G_b       = all_reduce(sum of G_out_shard rows)  (the bias is whole on every rank)

The W_shard^T passed to the ops is a transposed view ([K, n] with strides (1, K)), not a copy;
the fused kernels read it in place (their B_KN path), cuBLAS as a transposed operand.

FP8 (fp8=True, fluxtp.nn._fp8): the same functions with each of the three GEMMs (forward, input
gradient, weight gradient) in FP8 with dynamic row-wise scales (_Fp8Gemms); the parameters and
every gradient stay in their own dtype. save_memory keeps (and re-gathers) the FP8 rows and their
scales, so its weight gradient is bitwise the keeping way's.

Nothing beside a fused op: no plain collective of ours is in flight while a fused op runs.
The fused kernels are persistent (one program per SM) and spin on peers' signals; an NCCL
kernel holding SMs while it waits for a peer that is itself spinning could stall both. So the
save_memory re-gather runs after the input-gradient op, and the row bias all-reduce is issued
after the fused op and overlaps only the weight-gradient GEMM.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fluxtp._dist import GroupInfo, resolve_group
from fluxtp.nn._collectives import all_reduce_sum, gather_rows
from fluxtp.nn._fp8 import Fp8Gemms, check_fp8_dtype
from fluxtp.ops import all_gather_matmul, matmul_reduce_scatter
from fluxtp.ops._validate import check_backend


class _Gemms:
    """The layers' three GEMMs in the parameters' own precision; _fp8.Fp8Gemms has the same
    methods in FP8. `rows(x)` is what save_memory keeps of an input and `regather` gathers (here
    the tensor itself); `gathered` is what the all-gather GEMM returns beside its output and the
    weight gradient reads (here the gathered rows themselves); `grad` marks backward GEMMs."""

    @staticmethod
    def rows(x):
        return x

    @staticmethod
    def regather(rows, info: GroupInfo, backend: str):
        """`rows` of every rank, as gather_linear's `gathered` (save_memory's re-gather)."""
        return gather_rows(rows, info, backend)

    @staticmethod
    def gather_linear(x_shard, weight, bias, info: GroupInfo, backend: str, grad: bool = False, keep: bool = True,
                      rows=None):  # fmt: skip
        """(x_shard gathered @ weight^T + bias, gathered, or None unless `keep`); rows: `rows(x_shard)`
        where the caller has it already (FP8: not quantized twice)."""
        out = all_gather_matmul(x_shard, weight, group=info.group, bias=bias, backend=backend, return_gathered=keep)
        return out if keep else (out, None)

    @staticmethod
    def linear(gathered, weight, bias):
        """gathered @ weight^T + bias: another column layer on the gathered rows."""
        return torch.nn.functional.linear(gathered, weight, bias)

    @staticmethod
    def linear_reduce_scatter(x, weight, bias, info: GroupInfo, backend: str, grad: bool = False):
        return matmul_reduce_scatter(x, weight, group=info.group, bias=bias, backend=backend)

    @staticmethod
    def weight_grad(grad_rows, input_rows, dtype):
        """grad_rows^T @ input_rows: [T, n]^T @ [T, K] -> [n, K]."""
        return grad_rows.t() @ input_rows

    @staticmethod
    def pack(gathered) -> tuple:
        """`gathered` as the tensors save_for_backward takes (unpack inverts it)."""
        return (gathered,)

    @staticmethod
    def unpack(tensors):
        return tensors[0]


GEMMS = {False: _Gemms(), True: Fp8Gemms()}


class _ColumnParallelLinearFn(torch.autograd.Function):
    """One or more column-parallel linears reading the same input rows: one all-gather.

    forward(x_shard_m, info, backend, save_memory, keep_gathered, gemms, n, W_0..W_{n-1}, b_0..b_{n-1})
    -> (y_0..y_{n-1}). The gather is fused with W_0's GEMM; the others read the gathered copy, and
    so does the backward's weight gradient unless save_memory: keep_gathered says whether anything
    will (a call that keeps nothing takes the all-gather's cheaper path, fluxtp.ops). The backward
    sums their input gradients in one fused reduce-scatter: sum_i G_y_i @ W_i is
    [G_y_0 | G_y_1 | ...] @ [W_0; W_1; ...], so with n > 1 the gradients and the weights are
    concatenated (copies, cheaper than n reduce-scatters of [T, K] each).
    """

    PARAMS_AT = 7  # forward's index of W_0: after x_shard_m and six arguments that take no gradient

    @staticmethod
    def forward(ctx, x_shard_m, info: GroupInfo, backend: str, save_memory: bool, keep_gathered: bool, gemms, n: int,
                *params):  # fmt: skip
        weights, biases = params[:n], params[n:]
        rows = gemms.rows(x_shard_m) if save_memory else None  # what the backward keeps, made once
        y_0, gathered = gemms.gather_linear(x_shard_m, weights[0], biases[0], info, backend, keep=keep_gathered,
                                            rows=rows)  # fmt: skip
        ys = [y_0] + [gemms.linear(gathered, w, b) for w, b in zip(weights[1:], biases[1:])]
        saved = gemms.pack(rows) if save_memory else () if gathered is None else gemms.pack(gathered)
        ctx.save_for_backward(*weights, *saved)
        ctx.info, ctx.backend, ctx.save_memory, ctx.gemms, ctx.n = info, backend, save_memory, gemms, n
        ctx.has_bias = [b is not None for b in biases]
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grad_ys):
        n, gemms = ctx.n, ctx.gemms
        weights, saved = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        need_x = ctx.needs_input_grad[0]
        at = _ColumnParallelLinearFn.PARAMS_AT
        need_w = ctx.needs_input_grad[at : at + n]
        need_b = ctx.needs_input_grad[at + n :]
        grad_ys = [g.contiguous() for g in grad_ys]  # no-op in the usual case; ops want row-major rows
        grad_x_shard = None
        if need_x:
            if n == 1:
                grad_y_cat, w_cat = grad_ys[0], weights[0]
            else:
                grad_y_cat, w_cat = torch.cat(grad_ys, dim=1), torch.cat(weights, dim=0)
            grad_x_shard = gemms.linear_reduce_scatter(grad_y_cat, w_cat.t(), None, ctx.info, ctx.backend, grad=True)
        grad_ws = [None] * n
        if any(need_w):
            # Re-gathered after the fused op, not beside it (module docstring).
            x_gathered = gemms.unpack(saved)
            if ctx.save_memory:
                x_gathered = gemms.regather(x_gathered, ctx.info, ctx.backend)
            grad_ws = [
                gemms.weight_grad(g, x_gathered, w.dtype) if need else None for g, w, need in zip(grad_ys, weights, need_w)
            ]
        grad_bs = [g.sum(0) if has and need else None for g, has, need in zip(grad_ys, ctx.has_bias, need_b)]
        return (grad_x_shard, *[None] * (at - 1), *grad_ws, *grad_bs)


class _RowParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_k, w_shard_k, bias, info: GroupInfo, backend: str, gemms):
        out_shard = gemms.linear_reduce_scatter(x_k, w_shard_k, bias, info, backend)
        ctx.save_for_backward(x_k, w_shard_k)
        ctx.info, ctx.backend, ctx.gemms = info, backend, gemms
        ctx.has_bias = bias is not None
        return out_shard

    @staticmethod
    def backward(ctx, grad_out_shard):
        x_k, w_shard_k = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        info, gemms = ctx.info, ctx.gemms
        grad_out_shard = grad_out_shard.contiguous()
        grad_x = grad_out_gathered = None
        if need_x:
            grad_x, grad_out_gathered = gemms.gather_linear(grad_out_shard, w_shard_k.t(), None, info, ctx.backend,
                                                            grad=True, keep=need_w)  # fmt: skip
        elif need_w:
            grad_out_gathered = gather_rows(grad_out_shard, info, ctx.backend)
        bias_work = grad_b = None
        if ctx.has_bias and need_b:
            # The bias was added to this rank's rows only: sum the row sums over the group,
            # in flight during the weight-gradient GEMM only (issued after the fused op; see
            # "nothing beside a fused op" in the module docstring).
            grad_b = grad_out_shard.sum(0)
            bias_work = all_reduce_sum(grad_b, info, ctx.backend, async_op=True)
        grad_w = gemms.weight_grad(grad_out_gathered, x_k, w_shard_k.dtype) if need_w else None
        if bias_work is not None:
            bias_work.wait()
        return grad_x, grad_w, grad_b, None, None, None


def keeps_gathered_rows(weights, save_memory: bool, readers: int = 1) -> bool:
    """Whether an all-gather feeding `readers` linears of these weights should return its gathered
    rows: a second linear reads them, or the backward's weight gradient does (grad enabled, a
    weight requiring it, not save_memory). A call that keeps none takes the op's cheaper path."""
    weight_grads = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
    return readers > 1 or (weight_grads and not save_memory)


def _flatten_rows(x: torch.Tensor, features: int, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [..., {features}], got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != features:
        raise ValueError(f"{name} must be [rows, {features}] or [d0, ..., {features}], got shape {tuple(x.shape)}")
    return x.reshape(-1, features)


def _check_divides(world: int, features: int, what: str) -> int:
    if features % world:
        raise ValueError(f"{what}={features} must be divisible by the tensor-parallel world size {world}")
    return features // world


def _uniform_like_linear_(t: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default: kaiming_uniform(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound)


class _TensorParallelLinear(nn.Module):
    """What both parallel linears share: the group, the backend, the parameters and how they are
    initialized and copied from an nn.Linear."""

    def __init__(self, in_features: int, out_features: int, group, backend: str, fp8: bool):
        super().__init__()
        check_backend(backend)
        self.group = group
        self._info = resolve_group(group)
        self.in_features, self.out_features = in_features, out_features
        self.backend = backend
        self.fp8 = bool(fp8)
        self._gemms = GEMMS[self.fp8]

    def _make_parameters(self, weight_shape, bias_features: int, bias: bool, device, dtype) -> None:
        if self.fp8:
            check_fp8_dtype(type(self).__name__, dtype if dtype is not None else torch.get_default_dtype())
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(*weight_shape, **factory))
        self.bias = nn.Parameter(torch.empty(bias_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fan-in of the whole layer, so the shards together have nn.Linear's distribution.
        _uniform_like_linear_(self.weight, self.in_features)
        if self.bias is not None:
            nn.init.zeros_(self.bias)  # as Megatron; a replicated bias must start equal on every rank

    def _copy_from(self, linear: nn.Linear, weight_part: torch.Tensor, bias_part: torch.Tensor | None):
        """Copy this rank's part of `linear`, keeping its requires_grad flags; returns self."""
        with torch.no_grad():
            self.weight.copy_(weight_part)
            if bias_part is not None:
                self.bias.copy_(bias_part)
        self.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            self.bias.requires_grad_(linear.bias.requires_grad)
        return self


class ColumnParallelLinear(_TensorParallelLinear):
    """y = all_gather(x_shard) @ weight^T + bias, the weight split by output features.

    Args:
        in_features, out_features: of the whole (unsharded) layer; out_features % W == 0.
        group: the tensor-parallel process group (default: the world).
        bias: keep a bias (sharded like the output features).
        backend: "auto", "fused", "nccl", "torch" or a registered one (see fluxtp.backends): every
            communication of the layer, forward and backward, runs through it.
        save_memory: keep only this rank's input rows for the backward and re-gather them there
            (W times less saved activation memory, one more all-gather per backward).
        fp8: the forward and both backward GEMMs in FP8 e4m3 with dynamic row-wise scales
            (fluxtp.nn._fp8; parameters of bfloat16, float16 or float32).

    Shapes (W = group size, rank r):
        input:  x_shard [m, in_features], rank r's rows of x [m*W, in_features]; or
                [d0, d1, ..., in_features] standing for [W*d0, d1, ..., in_features].
        output: [m*W, out_features/W] (or [W*d0, d1, ..., out_features/W]): every row, output
                features r*out_features/W .. (r+1)*out_features/W - 1.
        weight: [out_features/W, in_features], bias: [out_features/W].

    A fresh layer has nn.Linear's weight distribution and a zero bias (as Megatron); use
    `from_linear` to shard an existing nn.Linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        backend: str = "auto",
        save_memory: bool = False,
        fp8: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, group, backend, fp8)
        self.out_features_local = _check_divides(self._info.world_size, out_features, "out_features")
        self.save_memory = save_memory
        n = self.out_features_local
        self._make_parameters((n, in_features), n, bias, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, backend: str = "auto", save_memory: bool = False,
                    fp8: bool = False):  # fmt: skip
        """This rank's block of output features of `linear` (rows of its weight), copied."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            group=group,
            bias=linear.bias is not None,
            backend=backend,
            save_memory=save_memory,
            fp8=fp8,
            device=w.device,
            dtype=w.dtype,
        )
        rows = slice(layer._info.rank * layer.out_features_local, (layer._info.rank + 1) * layer.out_features_local)
        return layer._copy_from(linear, w[rows], None if linear.bias is None else linear.bias[rows])

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        return column_parallel_linears(x_shard, [self])[0]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.out_features_local} of {self._info.world_size} ranks), bias={self.bias is not None}, "
            f"backend={self.backend!r}, save_memory={self.save_memory}" + (", fp8=True" if self.fp8 else "")
        )


def column_parallel_linears(x_shard: torch.Tensor, layers) -> tuple[torch.Tensor, ...]:
    """Several ColumnParallelLinear layers applied to the same input rows, with one all-gather.

    For q/k/v (or gate/up) projections of the same activations: the gather is fused with the
    first layer's GEMM and the others reuse the gathered rows (instead of gathering once per
    layer), the backward reduces all input gradients in one fused reduce-scatter, and only one
    gathered copy is kept for the weight gradients.

    Args:
        x_shard: [m, K] or [d0, ..., K], as for ColumnParallelLinear.
        layers: ColumnParallelLinear modules with the same in_features, group, backend,
            save_memory and fp8.

    Returns:
        One output per layer, each as ColumnParallelLinear returns it.
    """
    layers = list(layers)
    first = layers[0]
    for layer in layers:
        if not isinstance(layer, ColumnParallelLinear):
            raise TypeError(f"layers must be ColumnParallelLinear modules, got {type(layer).__name__}")
        same = (layer.in_features, layer._info.name, layer.backend, layer.save_memory, layer.fp8)
        if same != (first.in_features, first._info.name, first.backend, first.save_memory, first.fp8):
            raise ValueError(
                "layers sharing one all-gather need the same in_features, group, backend and save_memory, and fp8; got "
                f"{(first.in_features, first._info.name, first.backend, first.save_memory, first.fp8)} and {same}"
            )
    x_shard_m = _flatten_rows(x_shard, first.in_features, "x_shard")
    params = [layer.weight for layer in layers] + [layer.bias for layer in layers]
    keep_gathered = keeps_gathered_rows([layer.weight for layer in layers], first.save_memory, len(layers))
    ys = _ColumnParallelLinearFn.apply(
        x_shard_m, first._info, first.backend, first.save_memory, keep_gathered, first._gemms, len(layers), *params
    )
    if x_shard.dim() == 2:
        return tuple(ys)
    lead = (x_shard.shape[0] * first._info.world_size, *x_shard.shape[1:-1])
    return tuple(y.view(*lead, layer.out_features_local) for y, layer in zip(ys, layers))


class RowParallelLinear(_TensorParallelLinear):
    """out = reduce_scatter(x @ weight^T) + bias, the weight split by input features.

    Args:
        in_features, out_features: of the whole (unsharded) layer; in_features % W == 0.
        group: the tensor-parallel process group (default: the world).
        bias: keep a bias. It is whole ([out_features]) and replicated on every rank, added
            once to the reduced rows; its gradient is summed over the group in the backward,
            so every rank holds the full (identical) gradient.
        backend: as for ColumnParallelLinear.
        fp8: the three GEMMs in FP8, as for ColumnParallelLinear.

    Shapes (W = group size, rank r):
        input:  x [M, in_features/W], all rows, input features r*in/W .. (r+1)*in/W - 1 (what
                a ColumnParallelLinear returns); or [D0, d1, ..., in_features/W] with W | D0.
        output: [M/W, out_features], rank r's rows r*M/W .. (r+1)*M/W - 1 of the summed
                product (or [D0/W, d1, ..., out_features]).
        weight: [out_features, in_features/W], bias: [out_features].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        backend: str = "auto",
        fp8: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, group, backend, fp8)
        self.in_features_local = _check_divides(self._info.world_size, in_features, "in_features")
        # The bias is replicated (added once, after the sum): every rank holds all of it.
        self._make_parameters((out_features, self.in_features_local), out_features, bias, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, backend: str = "auto", fp8: bool = False):
        """This rank's block of input features of `linear` (columns of its weight), copied;
        the bias is copied whole."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            group=group,
            bias=linear.bias is not None,
            backend=backend,
            fp8=fp8,
            device=w.device,
            dtype=w.dtype,
        )
        k_local = layer.in_features_local
        cols = slice(layer._info.rank * k_local, (layer._info.rank + 1) * k_local)
        return layer._copy_from(linear, w[:, cols], linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_k = _flatten_rows(x, self.in_features_local, "x")
        world = self._info.world_size
        if x.shape[0] % world:
            raise ValueError(
                f"x has shape {tuple(x.shape)}: its first dim {x.shape[0]} must be divisible by the "
                f"tensor-parallel world size {world} to be scattered by rows (flatten to [tokens, features] "
                f"to shard the tokens instead)"
            )
        out_shard = _RowParallelLinearFn.apply(x_k, self.weight, self.bias, self._info, self.backend, self._gemms)
        if x.dim() == 2:
            return out_shard
        return out_shard.view(x.shape[0] // world, *x.shape[1:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_features_local} of {self._info.world_size} ranks), "
            f"out_features={self.out_features}, bias={self.bias is not None}, backend={self.backend!r}"
            + (", fp8=True" if self.fp8 else "")
        )
