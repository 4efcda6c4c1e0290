"""A device copy as a kernel: the all-gather's publish inside a recorded call graph, where a
kernel node's arguments cost less host time to update per call than a copy call does
(docs/perf-log.md)."""

import triton
import triton.language as tl


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """dst[:n] = src[:n], NUM_PROGRAMS programs striding over blocks of BLOCK elements."""
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n, NUM_PROGRAMS * BLOCK):
        index = start + offsets
        mask = index < n
        tl.store(dst_ptr + index, tl.load(src_ptr + index, mask=mask), mask=mask)
