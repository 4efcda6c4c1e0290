"""fluxtp.nn's DTensor styles (ColwiseParallel / RowwiseParallel) and the Llama plan against
torch's own styles on the same modules and data, on gloo worlds of 2 (tp 2) and 4 (dp 2 x tp 2).

Every rank builds the same modules from one seed, deep-copies them, parallelizes one copy with
torch's styles and one with fluxtp's, and runs both on the same inputs: outputs (type,
placements, values), input gradients and parameter gradients (placements, full values) must
agree. Then the plain Llama of examples/train_dtensor.py: fluxtp's plan, torch's plan and mixed
plans; 3 training steps with FSDP2 on dp against torch's plan and the single-device model; a
state_dict round trip through torch.distributed.checkpoint; bad input. One spawn per world
(each spawn pays the torch import), torch.compile in a spawn of its own.
"""

import copy
import importlib.util
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

from fluxtp.nn import ColwiseParallel, RowwiseParallel, tp_submesh
from fluxtp.nn.llama_plan import LlamaNames, llama_layer_plan, llama_model_plan, parallelize_llama
from fluxtp.testing import run_launch, run_on_ranks
from tests._cases import recording_return_gathered, rel_error

# Normwise relative error, fluxtp's styles against torch's, float64 (u = 1.1e-16). Both sum the
# same products in another order (rank partials reduced by a collective, other GEMM blocking):
# a value of a sum over K <= 64 terms differs by at most ~K*u (7e-15), typically sqrt(K)*u.
# Allowed 1e-12: far below any real bug (a wrong token block, a missing or doubled reduction
# is off by O(1)). Through the Llama (2 layers, softmax, RMSNorm, the loss) rounding
# compounds by a few times per layer; allowed 1e-10 as in tests/test_parallelize.py (measured
# ~1e-15). Training: 3 SGD steps at lr 0.5 amplify a gradient error by ~lr*|H| per step, still
# far below 1e-10. Checkpoints copy data: exact.
TOL_LAYER = 1e-12
TOL_MODEL = 1e-10

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_dtensor.py"


def _example():
    """examples/train_dtensor.py as a module (its Llama, data and loss), loaded once a process."""
    name = "train_dtensor_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _close(name: str, got, want, tol: float) -> None:
    """got (fluxtp) against want (torch): the same kind (DTensor or not), placements, values."""
    assert got is not None and want is not None, f"{name}: missing ({got is None}, {want is None})"
    assert isinstance(got, DTensor) == isinstance(want, DTensor), f"{name}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, DTensor):
        assert got.placements == want.placements, f"{name}: placements {got.placements}, torch's {want.placements}"
        got, want = got.full_tensor(), want.full_tensor()  # collective: every rank compares the same things
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, torch's {tuple(want.shape)}"
    err = rel_error(got.detach(), want.detach().double())
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def _compare_grads(tag, fx_model, torch_model, tol):
    fx_params = dict(fx_model.named_parameters())
    for name, p in torch_model.named_parameters():
        _close(f"{tag} grad {name}", fx_params[name].grad, p.grad, tol)


# --- styles on a norm + MLP block --------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim, hidden, bias):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=torch.float64)
        self.w1 = nn.Linear(dim, hidden, bias=bias, dtype=torch.float64)
        self.w2 = nn.Linear(hidden, dim, bias=bias, dtype=torch.float64)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(self.norm(x))))


def _block(seed, dim, hidden, bias):
    torch.manual_seed(seed)
    block = Block(dim, hidden, bias)
    with torch.no_grad():  # away from ones / zeros, where a misrouted gradient would hide
        block.norm.weight.normal_(1.0, 0.3)
        block.norm.bias.normal_(0.0, 0.3)
        if bias:
            block.w1.bias.normal_()
            block.w2.bias.normal_()
    return block


def _plans(case, seq_dim):
    """(fluxtp plan, torch plan) for the block. seq_dim None: no sequence parallelism."""
    seq = None if seq_dim is None else Shard(seq_dim)
    if seq is None:
        torch_plan = {"w1": TorchColwise(), "w2": TorchRowwise(use_local_output=case == "local_out")}
        fx_plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=case == "local_out")}
        return fx_plan, torch_plan
    use_local = case != "dtensor_out"
    torch_plan = {
        "norm": SequenceParallel(sequence_dim=seq_dim),
        "w1": TorchColwise(input_layouts=seq),
        "w2": TorchRowwise(output_layouts=seq, use_local_output=use_local),
    }
    fx_col = ColwiseParallel(input_layouts=seq, save_memory=case == "save_memory")
    fx_row = RowwiseParallel(output_layouts=seq, use_local_output=use_local)
    fx_plan = {"norm": SequenceParallel(sequence_dim=seq_dim), "w1": fx_col, "w2": fx_row}
    if case == "mixed_col":  # fluxtp's column beside torch's row
        fx_plan["w2"] = TorchRowwise(output_layouts=seq, use_local_output=use_local)
    if case == "mixed_row":  # torch's column beside fluxtp's row
        fx_plan["w1"] = TorchColwise(input_layouts=seq)
    return fx_plan, torch_plan


def check_block(tp, seed, full_shape, seq_dim, case, bias=True):
    """full_shape: the whole input; seq_dim: its sharded token dim (None: replicated input)."""
    dim, hidden = full_shape[-1], 8 * tp.size()
    ref = _block(seed, dim, hidden, bias)
    fx_plan, torch_plan = _plans(case, seq_dim)
    fx_block = parallelize_module(copy.deepcopy(ref), tp, fx_plan)
    torch_block = parallelize_module(copy.deepcopy(ref), tp, torch_plan)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(full_shape, generator=g, dtype=torch.float64)
    if seq_dim is not None:
        x = x.chunk(tp.size(), dim=seq_dim)[tp.get_local_rank()].contiguous()
    x_fx, x_torch = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_fx, y_torch = fx_block(x_fx), torch_block(x_torch)
    tag = f"block W={tp.size()} shape={full_shape} seq_dim={seq_dim} case={case} bias={bias}"
    _close(f"{tag} output", y_fx, y_torch, TOL_LAYER)
    g_out = torch.randn(_local(y_torch).shape, generator=g, dtype=torch.float64)
    if isinstance(y_torch, DTensor):
        g_out = DTensor.from_local(g_out, tp, y_torch.placements, run_check=False)
    y_fx.backward(g_out)
    y_torch.backward(g_out)
    _close(f"{tag} input grad", x_fx.grad, x_torch.grad, TOL_LAYER)
    _compare_grads(tag, fx_block, torch_block, TOL_LAYER)
    for name, p in fx_block.named_parameters():  # the parameters are the same DTensors
        q = torch_block.get_parameter(name)
        assert type(p) is type(q) and _local(p).shape == _local(q).shape, f"{tag} {name}"
        if isinstance(p, DTensor):
            assert p.placements == q.placements, f"{tag} {name}: {p.placements} vs {q.placements}"


def check_head(tp, seed, output_layout, use_local_output):
    """The LM-head case: column with Shard(1) input and Replicate() output (all-gathered logits),
    or Shard(-1) DTensor logits (for loss_parallel)."""
    torch.manual_seed(seed)
    head = nn.Linear(12, 6 * tp.size(), bias=False, dtype=torch.float64)
    kw = {"input_layouts": Shard(1), "output_layouts": output_layout, "use_local_output": use_local_output}
    fx = parallelize_module(copy.deepcopy(head), tp, ColwiseParallel(**kw))
    ref = parallelize_module(copy.deepcopy(head), tp, TorchColwise(**kw))
    x = torch.randn(3, 2 * tp.size(), 12, dtype=torch.float64).chunk(tp.size(), dim=1)[tp.get_local_rank()]
    x_fx, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_fx, y_ref = fx(x_fx), ref(x_ref)
    tag = f"head {kw}"
    _close(f"{tag} output", y_fx, y_ref, TOL_LAYER)
    y_fx.square().sum().backward()
    y_ref.square().sum().backward()
    _close(f"{tag} input grad", x_fx.grad, x_ref.grad, TOL_LAYER)
    _close(f"{tag} weight grad", fx.weight.grad, ref.weight.grad, TOL_LAYER)


def check_blocks(tp, seed):
    W = tp.size()
    case_seed = seed
    for shape, seq_dim in (((3, 4 * W, 16), 1), ((4 * W, 2, 16), 0), ((6 * W, 16), 0), ((1, 2 * W, 16), 1)):
        for case in ("plain", "save_memory", "dtensor_out"):
            check_block(tp, case_seed, shape, seq_dim, case, bias=case != "save_memory")
            case_seed += 10
    for case in ("mixed_col", "mixed_row"):
        check_block(tp, case_seed, (2, 2 * W, 16), 1, case)
        case_seed += 10
    # No sequence parallelism: replicated input, matmul_all_reduce (Replicate output).
    for case in ("plain", "local_out"):
        check_block(tp, case_seed, (3, 5, 16), None, case)
        check_block(tp, case_seed + 1, (7, 16), None, case, bias=False)
        case_seed += 10
    check_head(tp, case_seed, Replicate(), True)
    check_head(tp, case_seed + 1, Shard(-1), False)
    check_head(tp, case_seed + 2, Replicate(), False)


# --- the Llama of examples/train_dtensor.py --------------------------------------------------


def _llama_args(ex, **kw):
    return ex.LlamaArgs(**{"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "vocab_size": 64, **kw})


def _tokens(ex, seed, batch, seq, vocab, step=0):
    return ex.batch(vocab, batch, seq, seed, step)


def check_gathered_rows_asked(tp, seed):
    """The styles' all-gathers ask for the gathered rows only where a weight gradient reads them
    (the column forward's; the row backward's): no_grad, frozen weights and save_memory take the
    op's one-graph path. Outputs and input gradients are bitwise those of the keeping way."""
    from fluxtp.nn import linear as linear_module

    # The column op's all-gather and the row backward's, both through fluxtp.nn.linear's GEMMs.
    with recording_return_gathered((linear_module, "all_gather_matmul")) as asked:
        ref = _block(seed, 16, 8 * tp.size(), True)
        x = torch.randn(3, 4 * tp.size(), 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        x = x.chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous()

        def run(case, grad, frozen=False):
            block = parallelize_module(copy.deepcopy(ref), tp, _plans(case, 1)[0])
            for linear in (block.w1, block.w2):
                linear.weight.requires_grad_(not frozen)
            asked.clear()
            x_in = x.clone().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                y = block(x_in)
                if grad:
                    y.square().sum().backward()
            return list(asked), y.detach(), x_in.grad

        keeping, y, gx = run("plain", grad=True)
        assert keeping == [True, True], keeping  # the column forward's, the row backward's
        # save_memory is the column's: the row backward still keeps its rows for its weight gradient.
        for case, grad, frozen, want in (("plain", False, False, [False]), ("plain", True, True, [False, False]),
                                         ("save_memory", True, False, [False, True])):  # fmt: skip
            ask, y_case, gx_case = run(case, grad, frozen)
            tag = f"case={case} grad={grad} frozen={frozen}"
            assert ask == want, f"{tag}: asked {ask}, expected {want}"
            assert torch.equal(y_case, y), f"{tag}: the output differs from the keeping way's"
            assert not grad or torch.equal(gx_case, gx), f"{tag}: the input gradient differs from the keeping way's"


def check_llama(tp, seed, sequence_parallel=True, mixed=False):
    """fluxtp's plan (or a mixed one) against torch's plan: logits, loss and every gradient."""
    ex = _example()
    model = ex.build_model(_llama_args(ex), seed, torch.float64)
    torch_model = parallelize_llama(copy.deepcopy(model), tp, styles="torch", sequence_parallel=sequence_parallel)
    if mixed:
        # fluxtp's styles on attention, torch's on the MLP (with its PrepareModuleInput), per layer.
        fx_model = copy.deepcopy(model)
        names = LlamaNames()
        torch_layer = llama_layer_plan(styles="torch", attention_args=3)
        fx_layer = llama_layer_plan(styles="fluxtp")
        plan = {k: torch_layer[k] for k in (names.attention_norm, names.ffn_norm, names.mlp, names.gate, names.up, names.down)}
        plan.update({k: fx_layer[k] for k in (names.q, names.k, names.v, names.o)})
        parallelize_module(fx_model, tp, llama_model_plan(styles="fluxtp"))
        for layer in fx_model.layers:
            parallelize_module(layer, tp, plan)
    else:
        fx_model = parallelize_llama(copy.deepcopy(model), tp, styles="fluxtp", sequence_parallel=sequence_parallel)
    tokens = _tokens(ex, seed, 3, 4 * tp.size(), 64)
    tag = f"llama W={tp.size()} sp={sequence_parallel} mixed={mixed}"
    logits_fx, logits_torch = fx_model(tokens), torch_model(tokens)
    _close(f"{tag} logits", logits_fx, logits_torch, TOL_MODEL)
    ex.lm_loss(logits_fx, tokens).backward()
    ex.lm_loss(logits_torch, tokens).backward()
    _compare_grads(tag, fx_model, torch_model, TOL_MODEL)


def _train(ex, model, mesh, seed, steps, fsdp=True):
    """3 SGD steps on this dp replica's share of the global batch; the global losses."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["dp"]
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    local = 4 // dp.size()
    losses = []
    for step in range(steps):
        tokens = _tokens(ex, seed, 4, 8, 64, step)[dp.get_local_rank() * local : (dp.get_local_rank() + 1) * local]
        loss = ex.lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp.get_group())
        losses.append(loss.item() / dp.size())
    return losses


def check_training_and_checkpoint(mesh, seed, ckpt_dir):
    """fluxtp's and torch's plans with FSDP2 on dp train alike (and like one device); the trained
    fluxtp model's state_dict goes through DCP into a fresh torch-plan model and back."""
    import torch.distributed.checkpoint as dcp

    ex = _example()
    args = _llama_args(ex)
    model = ex.build_model(args, seed, torch.float64)
    reference = copy.deepcopy(model)
    fx = parallelize_llama(copy.deepcopy(model), mesh, styles="fluxtp")
    th = parallelize_llama(copy.deepcopy(model), mesh, styles="torch")
    fx_losses = _train(ex, fx, mesh, seed, 3)
    th_losses = _train(ex, th, mesh, seed, 3)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for step in range(3):
        tokens = _tokens(ex, seed, 4, 8, 64, step)
        loss = ex.lm_loss(reference(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    assert ref_losses[0] != ref_losses[-1]
    for step, (a, b, r) in enumerate(zip(fx_losses, th_losses, ref_losses)):
        assert abs(a - b) <= TOL_MODEL * abs(b), f"step {step}: fluxtp loss {a!r}, torch plan {b!r}"
        assert abs(a - r) <= TOL_MODEL * abs(r), f"step {step}: fluxtp loss {a!r}, one device {r!r}"
    fx_state, th_state = fx.state_dict(), th.state_dict()
    assert fx_state.keys() == th_state.keys() == reference.state_dict().keys()
    ref_state = reference.state_dict()
    for name, t in fx_state.items():
        assert isinstance(t, DTensor) and t.placements == th_state[name].placements, name
        assert t.device_mesh.mesh_dim_names == ("dp", "tp") or mesh.ndim == 1, name
        _close(f"trained {name} vs torch plan", t, th_state[name], TOL_MODEL)
        err = rel_error(t.full_tensor(), ref_state[name].double())
        assert err <= TOL_MODEL, f"trained {name} vs one device: rel err {err:.2e}"

    # DCP: fluxtp-trained -> fresh torch-plan model (another plan, same sharding) and back.
    dcp.save(fx_state, checkpoint_id=ckpt_dir)
    fresh = parallelize_llama(ex.build_model(args, seed + 1, torch.float64), mesh, styles="torch")
    _train(ex, fresh, mesh, seed, 0)  # FSDP2-wrapped, no steps: the same DTensor layout
    fresh_state = fresh.state_dict()
    dcp.load(fresh_state, checkpoint_id=ckpt_dir)
    for name, t in fx_state.items():
        assert torch.equal(fresh_state[name].full_tensor(), t.full_tensor()), f"DCP round trip changed {name}"
    fresh2 = parallelize_llama(ex.build_model(args, seed + 2, torch.float64), mesh, styles="fluxtp")
    _train(ex, fresh2, mesh, seed, 0)
    state2 = fresh2.state_dict()
    dcp.load(state2, checkpoint_id=ckpt_dir)
    tokens = _tokens(ex, seed, 2, 8, 64, 7)
    assert torch.equal(fresh2(tokens), fx(tokens)), "a model loaded from the checkpoint computes otherwise"


# --- bad input ---------------------------------------------------------------------------------


def check_errors(tp, world):
    W = tp.size()
    with pytest.raises(ValueError, match=r"out_features=7 must be divisible by the tensor-parallel size"):
        parallelize_module(nn.Linear(8, 7), tp, ColwiseParallel())
    with pytest.raises(ValueError, match=r"in_features=7 must be divisible by the tensor-parallel size"):
        parallelize_module(nn.Linear(7, 8), tp, RowwiseParallel())
    with pytest.raises(ValueError, match=r"input_layouts must be Replicate\(\) or Shard\(dim\), got Partial"):
        ColwiseParallel(input_layouts=Partial())
    with pytest.raises(ValueError, match=r"output_layouts must be Replicate\(\) .* got Shard\(-1\)"):
        RowwiseParallel(output_layouts=Shard(-1))
    with pytest.raises(ValueError, match="backend must be one of"):
        ColwiseParallel(backend="nope")
    with pytest.raises(TypeError, match="parallelizes nn.Linear modules, got Embedding"):
        parallelize_module(nn.Embedding(8, 8), tp, ColwiseParallel())
    row = parallelize_module(nn.Linear(4 * W, 8, dtype=torch.float64), tp, RowwiseParallel(output_layouts=Shard(2)))
    with pytest.raises(ValueError, match=r"feature dim of a 3-D output; expected Replicate\(\) or Shard\(d\)"):
        row(torch.randn(2, 2, 4, dtype=torch.float64))
    col = parallelize_module(nn.Linear(8, 2 * W, dtype=torch.float64), tp, ColwiseParallel(input_layouts=Shard(1)))
    uneven = distribute_tensor(torch.randn(2, 2 * W + 1, 8, dtype=torch.float64), tp, [Shard(1)])
    with pytest.raises(ValueError, match=rf"its size {2 * W + 1} must be divisible by the tensor-parallel size {W}"):
        col(uneven)
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 8\]"):
        col(torch.randn(2, 2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_module(col, tp, ColwiseParallel())
    # A 2-D mesh with a "tp" dimension works as its tp dimension; one without is refused.
    mesh = init_device_mesh("cpu", (world // W, W), mesh_dim_names=("dp", "tp"))
    linear = parallelize_module(nn.Linear(8, 2 * W), mesh, ColwiseParallel())
    assert linear.weight.device_mesh == mesh["tp"] and linear.weight.placements == (Shard(0),)
    on_2d = distribute_tensor(torch.randn(2, 2 * W, 8), mesh, [Replicate(), Shard(1)])
    with pytest.raises(ValueError, match="expected one on the tensor-parallel mesh"):
        linear(on_2d)
    # A 2-D mesh without a "tp" dimension (a new mesh: a collective, on every rank).
    unnamed = init_device_mesh("cpu", (world // W, W))
    with pytest.raises(ValueError, match=r"expected a 1-D DeviceMesh or one with a dimension named 'tp'"):
        tp_submesh(unnamed)
    ex = _example()
    with pytest.raises(ValueError, match="dimension named 'tp'"):
        parallelize_llama(ex.build_model(_llama_args(ex), 0, torch.float64), unnamed)
    with pytest.raises(ValueError, match=r"n_heads=3 must be divisible by the tensor-parallel size 2"):
        parallelize_llama(ex.build_model(_llama_args(ex, n_heads=3, n_kv_heads=3, dim=48), 0, torch.float64), tp)
    model = ex.build_model(_llama_args(ex, ffn_dim=47), 0, torch.float64)
    with pytest.raises(ValueError, match=r"layers.0.feed_forward.w1: out_features=47 must be divisible"):
        parallelize_llama(model, tp)
    assert not isinstance(model.layers[0].attention.wq.weight, DTensor), "a failed plan changed the model"
    with pytest.raises(ValueError, match="styles must be one of"):
        parallelize_llama(model, tp, styles="megatron")


def _body(rank, world, seed, ckpt_dir):
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    check_blocks(tp, seed)
    check_gathered_rows_asked(tp, seed + 500)
    check_llama(tp, seed + 1000)
    check_llama(tp, seed + 1001, sequence_parallel=False)
    check_llama(tp, seed + 1002, mixed=True)
    check_training_and_checkpoint(mesh, seed + 2000, ckpt_dir)
    check_errors(tp, world)


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "dp2-tp2"])
def test_styles_match_torch_styles(world, tmp_path):
    run_on_ranks(_body, world, random.randrange(1 << 30), str(tmp_path / "ckpt"), backend="gloo")


# --- torch.compile -----------------------------------------------------------------------------


def _compile_body(rank, world, seed):
    from torch._dynamo.testing import CompileCounterWithBackend

    ex = _example()
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = ex.build_model(_llama_args(ex), seed, torch.float64)
    eager = parallelize_llama(copy.deepcopy(model), tp)
    compiled_model = parallelize_llama(copy.deepcopy(model), tp)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    tokens = _tokens(ex, seed, 2, 4 * world, 64)
    for _ in range(2):  # the second call reuses the graph
        ex.lm_loss(compiled(tokens), tokens).backward()
    ex.lm_loss(eager(tokens), tokens).backward()
    ex.lm_loss(eager(tokens), tokens).backward()
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: a graph break or recompilation"
    targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    for op in ("colwise_gather", "rowwise_scatter"):
        assert f"fluxtp_nn.{op}.default" in targets, f"{op} is not in the compiled graph: {sorted(targets)}"
    _close("compiled logits", compiled(tokens), eager(tokens), TOL_LAYER)
    _compare_grads("compiled", compiled_model, eager, TOL_LAYER)


def test_compiled_llama_has_no_graph_break():
    """The whole parallelized Llama (fluxtp's plan, tp 2) under torch.compile(fullgraph=True):
    one graph, fluxtp's linears in it as single ops, same logits and gradients as eager."""
    run_on_ranks(_compile_body, 2, random.randrange(1 << 30), backend="gloo")


# --- the example, as a user launches it ----------------------------------------------------------


def _example_losses(cmd) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_launch(cmd, timeout=300, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)$", proc.stdout, re.MULTILINE)]


def test_example_trains_like_one_device():
    """examples/train_dtensor.py under torchrun, dp 2 x tp 2 with FSDP2, prints the losses of its
    --reference run (float64, SGD: a mis-scaled gradient would show; tolerance as TOL_MODEL)."""
    common = ["--dtype", "float64", "--optimizer", "sgd", "--lr", "0.5", "--steps", "3"]
    reference = _example_losses([sys.executable, str(_EXAMPLE), "--reference", *common])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    losses = _example_losses([*torchrun, str(_EXAMPLE), "--dp", "2", "--tp", "2", *common])
    assert len(reference) == len(losses) == 3 and reference[0] != reference[-1]
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) <= TOL_MODEL * abs(want), f"step {step}: loss {got!r}, one device {want!r}"
    usage = subprocess.run([sys.executable, str(_EXAMPLE), "--help"], capture_output=True, text=True, check=True)
    assert "torchrun --standalone --nproc-per-node 4 examples/train_dtensor.py --dp 2 --tp 2" in usage.stdout
