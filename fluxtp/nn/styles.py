"""DTensor parallel styles whose linears run fluxtp's ops: a one-line swap for PyTorch's
ColwiseParallel / RowwiseParallel in a `parallelize_module` plan (torchtitan-style models).

    from torch.distributed.tensor.parallel import parallelize_module, SequenceParallel
    from fluxtp.nn import ColwiseParallel, RowwiseParallel    # instead of torch's

    parallelize_module(block, mesh["tp"], {
        "attention_norm": SequenceParallel(),                  # output Shard(1) on the sequence
        "attention.wq": ColwiseParallel(input_layouts=Shard(1)),   # all_gather_matmul
        ...
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),  # matmul_reduce_scatter
    })

The parameters become the same DTensors PyTorch's styles make (weight Shard(0) for column,
Shard(1) for row; bias Shard(0) for column, Replicate() for row), so FSDP2 on another mesh
dimension, torch.distributed.checkpoint and state_dict keys are unchanged; inputs and outputs
have the placements PyTorch's styles give them (DTensors, or local tensors with
use_local_output). What differs is how a linear computes, by the placement of its input and
output on the tensor-parallel mesh dimension (W ranks):

    ColwiseParallel  input Shard(d), d a token dim   all_gather_matmul (the gather fused with the GEMM);
                                                     backward matmul_reduce_scatter + local weight grad
                     input Replicate()               local linear; backward matmul_all_reduce
                     output                          Shard(-1), redistributed to output_layouts if asked
    RowwiseParallel  input                           Shard(-1) (what a column style's output is)
                     output Replicate()              matmul_all_reduce; backward local GEMMs
                     output Shard(d), d a token dim  matmul_reduce_scatter; backward all_gather_matmul

PyTorch's ColwiseParallel redistributes a Shard(1) input to Replicate() (an all-gather, then
the GEMM); here that input is kept sharded and gathered inside the GEMM, so a sequence-parallel
plan drops the PrepareModuleInput redistribution to Replicate() in front of attention and MLP
(see fluxtp.nn.llama_plan). Each column linear then gathers its input itself: q, k and v
gather the same rows three times (each hidden behind its GEMM), where PyTorch's plan gathers once.

Token layout. The fused ops work on 2-D row-major [tokens, features] with rank r owning the
r-th contiguous block of rows. A DTensor sharded on token dim d (torchtitan's [batch, seq,
hidden] with Shard(1)) is mapped to that by moving dim d to the front, [seq, batch, hidden],
and flattening: rank r's rows are then exactly its sequence block. With d = 0, or when every
dim before d has size 1 (batch 1), the move is free; otherwise it costs one copy of the local
input (column: the local shard, row: the [tokens, K/W] input) and one of the output gradient
in the backward, about what DTensor's own Shard(1) all-gather / reduce-scatter copy (they run
on dim 0 and permute). Outputs are returned as views in the caller's dim order (no copy).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from fluxtp._dist import GroupInfo, resolve_group
from fluxtp.nn import _style_ops
from fluxtp.nn.linear import keeps_gathered_rows
from fluxtp.ops._validate import check_backend


def tp_submesh(mesh: DeviceMesh, tp_dim: str = "tp") -> DeviceMesh:
    """The tensor-parallel dimension of `mesh`: a 1-D mesh itself, else its dimension named
    `tp_dim` (ValueError when it has none)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if not names or tp_dim not in names:
        raise ValueError(
            f"expected a 1-D DeviceMesh or one with a dimension named {tp_dim!r}, got a {mesh.ndim}-D mesh "
            f"with mesh_dim_names={names}; name the tensor-parallel dimension (init_device_mesh(..., "
            f"mesh_dim_names=(..., {tp_dim!r}))) or pass mesh[{tp_dim!r}]"
        )
    return mesh[tp_dim]


def _check_layout(what: str, placement, allowed: str, default: Placement) -> Placement:
    if placement is None:
        return default
    if isinstance(placement, (tuple, list)) and len(placement) == 1:
        placement = placement[0]
    if isinstance(placement, Replicate) or type(placement) is Shard:
        return placement
    raise ValueError(f"{what} must be {allowed}, got {placement!r}")


def _check_tokens(x: DTensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"{what} has shape {tuple(x.shape)} sharded on dim {dim} (Shard({dim})): its size {x.shape[dim]} must be "
            f"divisible by the tensor-parallel size {world} (the fused ops need equal token blocks per rank)"
        )


def _tokens_first(x_local: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x_local [..., K] sharded on token dim `dim` -> 2-D [rows, K] with `dim` outermost (a view
    when the dims before `dim` have size 1, else one copy), and the moved leading shape."""
    moved = x_local.movedim(dim, 0)
    return moved.reshape(-1, moved.shape[-1]), tuple(moved.shape[:-1])


def _tokens_back(rows: torch.Tensor, lead: tuple[int, ...], dim: int) -> torch.Tensor:
    """Inverse of _tokens_first for an output of other row count / features: a view."""
    return rows.view(*lead, rows.shape[-1]).movedim(0, dim)


class _FluxLinearStyle(ParallelStyle):
    """What both styles share: layouts, the backend, partitioning an nn.Linear's parameters."""

    _weight_shard_dim: int  # 0: column (output features), 1: row (input features)

    def __init__(self, input_layouts, output_layouts, use_local_output, backend, tp_dim):
        super().__init__()
        check_backend(backend)
        self.input_layouts = (input_layouts,)
        self.output_layouts = (output_layouts,)
        self.use_local_output = use_local_output
        self.backend = backend
        self.tp_dim = tp_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, nn.Linear):
            raise TypeError(f"fluxtp.nn.{name} parallelizes nn.Linear modules, got {type(module).__name__}")
        if isinstance(module.weight, DTensor):
            raise ValueError(f"{module} is already parallelized (its weight is a DTensor); apply one style per module")
        mesh = tp_submesh(device_mesh, self.tp_dim)
        world = mesh.size()
        features, what = (
            (module.out_features, "out_features") if self._weight_shard_dim == 0 else (module.in_features, "in_features")
        )
        if features % world:
            raise ValueError(
                f"{name} on {module}: {what}={features} must be divisible by the tensor-parallel size {world} "
                f"(the fused ops need equal shards)"
            )
        src = self.src_data_rank
        shard = Shard(self._weight_shard_dim)
        module.register_parameter(
            "weight",
            nn.Parameter(distribute_tensor(module.weight, mesh, [shard], src_data_rank=src), module.weight.requires_grad),
        )
        if module.bias is not None:
            bias_placement = Shard(0) if self._weight_shard_dim == 0 else Replicate()
            module.register_parameter(
                "bias",
                nn.Parameter(
                    distribute_tensor(module.bias, mesh, [bias_placement], src_data_rank=src), module.bias.requires_grad
                ),
            )
        module._fluxtp_style = (self, mesh, resolve_group(mesh.get_group()))
        # An instance attribute: state_dict keys, the class (FSDP2 subclasses it) and hooks stay as they are.
        module.forward = types.MethodType(self._forward_fn(), module)
        return module

    def _input_dtensor(self, x, mesh: DeviceMesh, module: nn.Module) -> DTensor:
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(
                    f"input of {module} is a DTensor on mesh {x.device_mesh}; expected one on the tensor-parallel "
                    f"mesh {mesh} (the mesh this style was applied with)"
                )
            return x
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fluxtp.nn.{type(self).__name__}: input must be a torch.Tensor or DTensor, got {type(x).__name__}")
        return DTensor.from_local(x, mesh, self.input_layouts, run_check=False)

    def _finish(self, y_local: torch.Tensor, placement: Placement, mesh: DeviceMesh):
        """The output in output_layouts, local or a DTensor (use_local_output)."""
        ndim = y_local.dim()
        wanted = _normalized(self.output_layouts[0], ndim)
        if self.use_local_output and _normalized(placement, ndim) == wanted:
            return y_local  # skip a from_local / to_local pair (both identities for autograd)
        y = DTensor.from_local(y_local, mesh, [placement], run_check=False)
        if _normalized(placement, ndim) != wanted:
            y = y.redistribute(mesh, [wanted])
        return y.to_local() if self.use_local_output else y

    def __repr__(self) -> str:
        return (
            f"fluxtp.nn.{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output}, backend={self.backend!r})"
        )


def _normalized(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim % ndim) if type(p) is Shard else p


def _local_params(module: nn.Module):
    w = module.weight
    b = module.bias
    return w.to_local(), (b.to_local() if b is not None else None)


class ColwiseParallel(_FluxLinearStyle):
    """Column-parallel nn.Linear (weight Shard(0): output features split over the TP ranks).

    Keyword Args (as torch's ColwiseParallel, plus backend / save_memory / tp_dim):
        input_layouts: placement of a plain-tensor input on the TP dimension (default
            Replicate()). Shard(d) on a token dim (sequence parallelism; torchtitan: Shard(1))
            runs all_gather_matmul. A DTensor input is taken with its own placement: Shard(d)
            on a token dim is gathered in the GEMM, Replicate() runs locally, Shard on the
            feature dim is first redistributed to Replicate().
        output_layouts: placement of the output (default Shard(-1), the computed layout; others
            are redistributed to, e.g. Replicate() for an LM head without loss parallelism).
        use_local_output: return the local torch.Tensor instead of the DTensor (default True).
        backend: "auto", "fused", "nccl" or "torch": the fluxtp backend, forward and backward.
        save_memory: keep only the local input rows for the backward (sequence-parallel input)
            and re-gather them there, W times less saved activation memory.
        tp_dim: the mesh dimension name to use when the mesh given is not 1-D (default "tp").
    """

    _weight_shard_dim = 0

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        backend: str = "auto",
        save_memory: bool = False,
        tp_dim: str = "tp",
    ):
        super().__init__(
            _check_layout("ColwiseParallel input_layouts", input_layouts, "Replicate() or Shard(dim)", Replicate()),
            _check_layout("ColwiseParallel output_layouts", output_layouts, "Replicate() or Shard(dim)", Shard(-1)),
            use_local_output,
            backend,
            tp_dim,
        )
        self.save_memory = save_memory

    def _forward_fn(self):
        def forward(module: nn.Linear, x):
            style, mesh, info = module._fluxtp_style
            return style._column(module, x, mesh, info)

        return forward

    def _column(self, module: nn.Linear, x, mesh: DeviceMesh, info: GroupInfo):
        x = self._input_dtensor(x, mesh, module)
        if x.shape[-1] != module.in_features:
            raise ValueError(f"input of {module} has shape {tuple(x.shape)}: expected [..., {module.in_features}]")
        ndim = x.dim()
        p = _normalized(x.placements[0], ndim)
        w_local, b_local = _local_params(module)
        if type(p) is Shard and p.dim != ndim - 1:
            _check_tokens(x, p.dim, info.world_size, f"input of {module}")
            x_rows, lead = _tokens_first(x.to_local(), p.dim)
            # Without gathered rows to keep, the op's save_memory form, which returns none.
            keep = keeps_gathered_rows([module.weight], self.save_memory)
            y_rows, _ = _style_ops.colwise_gather(x_rows, w_local, b_local, info.name, self.backend, not keep)
            y_local = _tokens_back(y_rows, (lead[0] * info.world_size, *lead[1:]), p.dim)
        else:
            if not isinstance(p, Replicate):
                x = x.redistribute(mesh, [Replicate()])
            x_local = x.to_local()
            x_rows = x_local.reshape(-1, x_local.shape[-1])
            y_rows = _style_ops.colwise_replicated(x_rows, w_local, b_local, info.name, self.backend)
            y_local = y_rows.view(*x_local.shape[:-1], y_rows.shape[-1])
        return self._finish(y_local, Shard(ndim - 1), mesh)


class RowwiseParallel(_FluxLinearStyle):
    """Row-parallel nn.Linear (weight Shard(1): input features split over the TP ranks; the
    bias whole, Replicate()).

    Keyword Args (as torch's RowwiseParallel, plus backend / tp_dim):
        input_layouts: placement of a plain-tensor input (default Shard(-1), what a column
            style's local output is). A DTensor input of another placement is redistributed
            to Shard(-1), as torch's style does.
        output_layouts: Replicate() (default): matmul_all_reduce; Shard(d) on a token dim
            (sequence parallelism; torchtitan: Shard(1)): matmul_reduce_scatter. Shard on the
            feature dim is refused (ValueError).
        use_local_output: return the local torch.Tensor instead of the DTensor (default True).
        backend: "auto", "fused", "nccl" or "torch", forward and backward.
        tp_dim: the mesh dimension name to use when the mesh given is not 1-D (default "tp").
    """

    _weight_shard_dim = 1

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        backend: str = "auto",
        tp_dim: str = "tp",
    ):
        output = _check_layout(
            "RowwiseParallel output_layouts", output_layouts, "Replicate() or Shard(token dim)", Replicate()
        )
        if type(output) is Shard and output.dim == -1:
            raise ValueError(
                "RowwiseParallel output_layouts must be Replicate() (matmul_all_reduce) or Shard(d) on a token dim "
                "(matmul_reduce_scatter), got Shard(-1): the output features are not what the ops scatter"
            )
        super().__init__(
            _check_layout("RowwiseParallel input_layouts", input_layouts, "Shard(-1) or Replicate()", Shard(-1)),
            output,
            use_local_output,
            backend,
            tp_dim,
        )

    def _forward_fn(self):
        def forward(module: nn.Linear, x):
            style, mesh, info = module._fluxtp_style
            return style._row(module, x, mesh, info)

        return forward

    def _row(self, module: nn.Linear, x, mesh: DeviceMesh, info: GroupInfo):
        x = self._input_dtensor(x, mesh, module)
        if x.shape[-1] != module.in_features:
            raise ValueError(f"input of {module} has shape {tuple(x.shape)}: expected [..., {module.in_features}]")
        ndim = x.dim()
        if _normalized(x.placements[0], ndim) != Shard(ndim - 1):
            x = x.redistribute(mesh, [Shard(ndim - 1)])
        out = _normalized(self.output_layouts[0], ndim)
        if type(out) is Shard and out.dim == ndim - 1:
            raise ValueError(
                f"RowwiseParallel on {module}: output_layouts {self.output_layouts[0]!r} is the feature dim of a "
                f"{ndim}-D output; expected Replicate() or Shard(d) on a token dim"
            )
        w_local, b_local = _local_params(module)
        x_local = x.to_local()
        if isinstance(out, Replicate):
            x_rows = x_local.reshape(-1, x_local.shape[-1])
            y_rows = _style_ops.rowwise_reduce(x_rows, w_local, b_local, info.name, self.backend)
            y_local = y_rows.view(*x_local.shape[:-1], y_rows.shape[-1])
        else:
            _check_tokens(x, out.dim, info.world_size, f"input of {module} (output_layouts {out!r})")
            x_rows, lead = _tokens_first(x_local, out.dim)
            y_rows = _style_ops.rowwise_scatter(x_rows, w_local, b_local, info.name, self.backend)
            y_local = _tokens_back(y_rows, (lead[0] // info.world_size, *lead[1:]), out.dim)
        return self._finish(y_local, out, mesh)
