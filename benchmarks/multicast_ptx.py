"""Probe (not product, CPU only): can Triton's Gluon write the 2-CTA multicast pipeline cuBLAS runs
on Hopper? Read from the PTX of small kernels compiled offline for sm_90.

The kernel is the loader side of a pipelined GEMM over a 2-CTA cluster: a ring of stages of B (the
operand both CTAs share, shared layout cga_layout [[0, 0]]), each stage loaded by
`tma.async_load(..., multicast=True)`, waited for, and released. Such a pipeline needs loads that
run ahead without the whole cluster meeting at each one, and a consumer in either CTA releasing the
stage in both (a remote arrive: the multicast refills both CTAs' buffers). Three variants:
- `barriers initialised`: the barriers' init fenced for the cluster before the loop, as a kernel
  must; without it the compiler puts a cluster barrier before every load (`inits not fenced`);
- `remote release`: the release by the only multicast arrive Gluon has (its Rubin module's
  `arrive(cta_mask=1)`); Hopper's `mbarrier.arrive` reaches its own CTA only.

    python benchmarks/multicast_ptx.py   # Triton 3.8+ (its Gluon has multicast=); no GPU needed
"""

import contextlib
import io
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia import rubin
from triton.experimental.gluon.language.nvidia.hopper import cluster, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

BLOCK = (128, 64)
SHARED_BY_BOTH = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=[[0, 0]])
VARIANTS = {  # name: (FENCE_INITS, REMOTE_RELEASE)
    "inits not fenced": (False, False),
    "barriers initialised": (True, False),
    "remote release": (True, True),
}


@gluon.jit
def multicast_ring(b_desc, K, STAGES: gl.constexpr, FENCE_INITS: gl.constexpr, REMOTE_RELEASE: gl.constexpr):
    BK: gl.constexpr = b_desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=2)
    if FENCE_INITS:
        mbarrier.fence_init_release_cluster()
        cluster.barrier(relaxed=True)
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
        tma.async_load(b_desc, [0, i * BK], ready.index(s), bufs.index(s), multicast=True)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if REMOTE_RELEASE:
            rubin.mbarrier.arrive(empty.index(s), cta_mask=1)
        else:
            mbarrier.arrive(empty.index(s))


def compile_variant(fence_inits: bool, remote_release: bool) -> str:
    """The variant's PTX, or the compiler's error (its first line and ptxas's complaint)."""
    b = torch.empty(256, 4096, dtype=torch.float16)  # CPU: only the descriptor's type is used
    desc = TensorDescriptor.from_tensor(b, list(BLOCK), SHARED_BY_BOTH)
    signature = {"b_desc": mangle_type(desc), "K": "i32", "STAGES": "constexpr", "FENCE_INITS": "constexpr",
                 "REMOTE_RELEASE": "constexpr"}  # fmt: skip
    constexprs = {"STAGES": 3, "FENCE_INITS": fence_inits, "REMOTE_RELEASE": remote_release}
    source = GluonASTSource(multicast_ring, signature=signature, constexprs=constexprs)
    try:  # the compiler prints a failing kernel's whole PTX: kept out of the report
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_ctas": 2}).asm["ptx"]
    except Exception as error:  # ptxas rejecting the PTX: its message says which instruction
        return "ERROR " + " | ".join(line for line in str(error).splitlines() if "error" in line.lower())


def main():
    print(f"Triton {triton.__version__}, sm_90, num_ctas=2")
    for name, flags in VARIANTS.items():
        ptx = compile_variant(*flags)
        print(f"\n{name}:")
        if ptx.startswith("ERROR"):
            print("  does not compile:", ptx[len("ERROR ") :])
            continue
        loop = ptx[ptx.index("$L__BB0_") :]
        loop = loop[: loop.index("bra")]  # the ring's loop body, up to its back branch
        arrives = sorted(set(re.findall(r"mbarrier\.arrive[\w.:]*", ptx)))
        print("  multicast load in the loop:     ", "multicast::cluster" in loop)
        print("  cluster barrier in the loop:    ", "barrier.cluster.wait" in loop)
        print("  mbarrier arrives:               ", ", ".join(arrives))


if __name__ == "__main__":
    main()
