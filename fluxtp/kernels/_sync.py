"""Device-side synchronization: bounded spin-waits with acquire semantics, release stores.

A flag is a 32-bit word. A waiter spins on an atomic read with acquire semantics until the
flag holds the value it expects, at most `max_spins` reads; on timeout the kernel traps, so
the launch fails with an error instead of hanging (no device_print in hot kernels: the printf
call slows the whole kernel down). The trap is inline PTX, which
the Triton interpreter cannot run: interpreter tests preset every flag so it is never reached.
Scope: "gpu" for flags written on this GPU (its copy stream), "sys" for flags a peer writes.
"""

import os

import triton
import triton.language as tl


@triton.jit
def trap():
    """Abort the kernel (cudaErrorLaunchFailure on the host): a wait that will never finish."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# The interpreter (TRITON_INTERPRET=1, read before triton is imported) runs no inline PTX.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def fence_async_proxy():
    """Order this thread's generic-proxy accesses before (a flag's acquire) before its async-proxy
    ones after (TMA loads of the data the flag publishes): the PTX memory model orders accesses of
    different proxies only through a proxy fence. None under the interpreter: one memory, no proxies."""
    if not INTERPRETED:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.jit
def wait_flag(flag_ptr, expected, max_spins, SCOPE: tl.constexpr):
    """Spin until *flag_ptr == expected (acquire); returns whether it arrived within max_spins."""
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (value != expected) & (spins < max_spins):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
    return value == expected


@triton.jit
def wait_flags(flag_ptrs, mask, expected, max_spins, SCOPE: tl.constexpr):
    """Spin until every unmasked *flag_ptrs == expected (acquire), all flags read in each round
    (one memory round trip for all of them, not one per flag); returns which arrived (masked
    lanes count as arrived) within max_spins rounds."""
    values = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
    arrived = (values == expected) | ~mask
    spins = 0
    while (tl.min(arrived.to(tl.int32), 0) == 0) & (spins < max_spins):
        values = tl.atomic_add(flag_ptrs, 0, mask=mask & ~arrived, sem="acquire", scope=SCOPE)
        arrived = arrived | (mask & (values == expected))
        spins += 1
    return arrived


@triton.jit
def wait_flag_at_least(flag_ptr, target, max_spins, SCOPE: tl.constexpr):
    """Spin until *flag_ptr has reached `target` (acquire), for flags that count calls (epochs).

    Counters only grow, and a peer may already have moved on to a later call, so "reached" is
    `flag - target >= 0` in wrapping int32 arithmetic: correct across the 2^32 wrap as long as
    the two are less than 2^31 calls apart. Returns whether it arrived within max_spins."""
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while ((value - target) < 0) & (spins < max_spins):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
    return (value - target) >= 0


@triton.jit
def set_flag(flag_ptr, value, SCOPE: tl.constexpr):
    """Publish everything this program wrote before, then the flag (release)."""
    tl.atomic_xchg(flag_ptr, value, sem="release", scope=SCOPE)


@triton.jit
def give_up(report_ptr, flag_ptr, src, tile, RANK: tl.constexpr):
    """Record which wait timed out where the host can read it after the trap, then trap."""
    tl.store(report_ptr, src)
    tl.store(report_ptr + 1, tile)
    tl.store(report_ptr + 2, RANK)
    tl.atomic_add(flag_ptr, 0, sem="release", scope="sys")  # its fence makes the record visible first
    tl.debug_barrier()  # (one thread wrote it) no thread traps before that fence has completed
    trap()


# Store (a, b, c) at $1, fence system-wide, trap: one asm block, so whichever thread traps first
# has made the record visible (every thread runs it). Shared with the Gluon kernels' copy.
RECORD_AND_TRAP_PTX = tl.constexpr(
    "st.global.b32 [$1], $2; st.global.b32 [$1+4], $3; st.global.b32 [$1+8], $4; membar.sys; trap; mov.u32 $0, 0;"
)


@triton.jit
def record_and_trap(report_ptr, src, index, RANK: tl.constexpr):
    """give_up for a loop the pipeliner must keep (a CTA barrier in a loop body stops it): every
    thread stores the same record, fences it system-wide and traps, all in one asm block, so
    whichever thread traps first has made the record visible."""
    tl.inline_asm_elementwise(
        RECORD_AND_TRAP_PTX,
        "=r,l,r,r,r",
        [report_ptr, src, index, tl.full((), RANK, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
