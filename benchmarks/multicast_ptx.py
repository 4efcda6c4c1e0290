"""Probe (not product, CPU only): what Triton's Gluon makes of a 2-CTA cluster's TMA multicast on
Hopper, read from the PTX of a small kernel compiled offline for sm_90.

The kernel is the loader side of a pipelined GEMM over a 2-CTA cluster: a ring of stages of B (the
operand both CTAs share, shared layout cga_layout [[0, 0]]), each stage loaded by
`tma.async_load(..., multicast=True)` and waited for on an mbarrier, and one consumer release
(`mbarrier.arrive`) a stage. A warp-specialized multicast pipeline (CUTLASS's) needs two things:
loads that run ahead without the whole cluster meeting at each one, and consumers in either CTA
releasing a stage in both (a remote arrive). The probe prints where each stands.

    python benchmarks/multicast_ptx.py   # Triton 3.8+ (its Gluon has multicast=); no GPU needed
"""

import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

BLOCK = (128, 64)
SHARED_BY_BOTH = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=[[0, 0]])


@gluon.jit
def multicast_ring(b_desc, K, STAGES: gl.constexpr):
    BK: gl.constexpr = b_desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
        tma.async_load(b_desc, [0, i * BK], ready.index(s), bufs.index(s), multicast=True)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(s))  # the consumer's release of the stage


def main():
    b = torch.empty(256, 4096, dtype=torch.float16)  # CPU: only the descriptor's type is used
    desc = TensorDescriptor.from_tensor(b, list(BLOCK), SHARED_BY_BOTH)
    signature = {"b_desc": mangle_type(desc), "K": "i32", "STAGES": "constexpr"}
    source = GluonASTSource(multicast_ring, signature=signature, constexprs={"STAGES": 3})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_ctas": 2}).asm["ptx"]

    body = ptx[ptx.index("$L__BB0_") :]  # from the first loop label on
    loop = body[: body.index("bra")]  # the loop's body, up to its branch
    print(f"Triton {triton.__version__}, sm_90, num_ctas=2")
    print("multicast TMA load in the loop:   ", "multicast::cluster" in loop)
    print("cluster barrier in the loop:      ", "barrier.cluster.wait" in loop)
    print("the load issued by one CTA only:  ", "%cluster_ctarank" in ptx)
    arrives = sorted(set(re.findall(r"mbarrier\.arrive[\w.:]*", ptx)))
    print("mbarrier arrives:                 ", ", ".join(arrives))
    print("a remote (shared::cluster) arrive:", any("shared::cluster" in a for a in arrives))


if __name__ == "__main__":
    main()
