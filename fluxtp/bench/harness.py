"""The timing protocol of every fluxtp benchmark (GPU machines are shared and noisy).

1. Warm-up. Every variant first runs `warmup_rounds` interleaved samples that are thrown
   away: Triton compiles, symmetric buffers are allocated and rendezvoused, clocks ramp up.
2. Interleaving. Variants are measured in rounds, each round every variant once, in the orders
   of a balanced Latin square (round_order): over n rounds of n variants every variant takes
   every position once and follows every other variant once (over 2n rounds when n is odd).
   Clock drift and a neighbour's load then hit every variant alike, and no variant gains from
   its place or its predecessor: on 2x H200 the fused all-gather at M 16384 timed 3-4% faster
   right after NCCL than right after another fused variant (docs/perf-log.md), and with plain
   rotation (A B C, B C A, ...) B still followed A in all but one round of n.
3. One sample. The ranks finish their queued work and meet at a barrier (untimed), then
   `calls_per_sample` back-to-back calls run between two CUDA events (a wall clock on CPU);
   the sample is the elapsed time divided by the number of calls.
4. Cold inputs. When one set of inputs would fit in `ROTATE_BELOW_CACHE_MULTIPLE` times the
   last-level cache (L2 on GPUs), the variant gets several copies and call i uses copy
   i mod n, so no call finds its inputs already cached by the previous one.
5. Reduction. The median of the samples per variant on each rank, then the maximum over the
   ranks: a tensor-parallel step is as slow as its slowest rank.
6. Derived numbers, against variants of the same run only (never across runs):
   E_overlap = 1 - (T_x - T_gemm) / (T_nccl - T_gemm)  (1: communication fully hidden,
   0: no better than NCCL then GEMM, negative: slower) and speedup_vs_nccl = T_nccl / T_x.
7. Spread. Each round's samples run back to back, so slow drift (clocks, a neighbour's load)
   hits a round's variants alike: the per-round ratios T_nccl / T_x (slowest rank per sample)
   and their middle half (speedup_vs_nccl_iqr) say how far one run's speedup can be trusted.
   On 2x H200, "auto" timed beside the fused backend it picked read up to 4% apart in ratio of
   medians at M 16384 (docs/perf-log.md).
8. Sustained spells (measure_sustained; one GPU). Interleaved samples share one clock, which on a
   power-capped GPU the mix of variants sets: they compare work per cycle. Run alone for seconds,
   a variant settles at the clock its own power draw allows, as a stream of like calls would; its
   spells (in alternating order) read the time a call and the SM clock and power beside it.

Inputs are random, never zeros (zeros make GEMMs and links cheaper than real data).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from fluxtp._dist import GroupInfo, max_over_ranks
from fluxtp.bench.gpu_state import ClockSampler

# A set of inputs smaller than this many caches gets rotated copies (protocol step 4).
ROTATE_BELOW_CACHE_MULTIPLE = 4
MAX_INPUT_COPIES = 16
_FALLBACK_CACHE_BYTES = 32 << 20


@dataclass(frozen=True)
class Protocol:
    """How many samples of how many calls (see the module docstring)."""

    rounds: int
    warmup_rounds: int
    calls_per_sample: int

    def __post_init__(self):
        if self.rounds < 1 or self.warmup_rounds < 0 or self.calls_per_sample < 1:
            raise ValueError(f"invalid timing protocol {self}: need rounds >= 1, warmup_rounds >= 0, calls >= 1")


# GPU samples are short and cheap; CPU (gloo) demo samples are slow, so fewer of them.
GPU_PROTOCOL = Protocol(rounds=20, warmup_rounds=3, calls_per_sample=5)
CPU_PROTOCOL = Protocol(rounds=5, warmup_rounds=1, calls_per_sample=3)


@dataclass(frozen=True)
class Variant:
    """One thing to time: `calls[i % len(calls)]` is the i-th call (one callable per input copy)."""

    name: str
    calls: tuple[Callable[[], object], ...]

    def __post_init__(self):
        if not self.calls:
            raise ValueError(f"variant {self.name!r} has no calls")


def cache_bytes(device: torch.device) -> int:
    """L2 size of a GPU; on CPU the largest cache level sysfs lists (fallback 32 MiB)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "L2_cache_size", 0)) or _FALLBACK_CACHE_BYTES
    sizes = []
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=_FALLBACK_CACHE_BYTES)


def input_copies(set_bytes: int, cache: int) -> int:
    """How many copies of one input set to rotate so that a call never finds its inputs cached."""
    threshold = ROTATE_BELOW_CACHE_MULTIPLE * cache
    if set_bytes >= threshold:
        return 1
    return min(MAX_INPUT_COPIES, math.ceil(threshold / max(set_bytes, 1)))


def overlap_efficiency(t_x: float, t_gemm: float, t_nccl: float) -> float | None:
    """E_overlap = 1 - ECT_x / ECT_nccl; None when NCCL exposed no time to hide (ECT_nccl <= 0)."""
    exposed_baseline = t_nccl - t_gemm
    if exposed_baseline <= 0:
        return None
    return 1.0 - (t_x - t_gemm) / exposed_baseline


def speedup(t_nccl: float, t_x: float) -> float | None:
    return None if t_x <= 0 else t_nccl / t_x


def speedup_iqr(timings: Timings, baseline: str, names) -> dict[str, list[float]]:
    """Per name, [p25, p75] of the per-round speedups baseline / name (Timings.ratio_quartiles)."""
    spread = {}
    for name in names:
        quartiles = timings.ratio_quartiles(baseline, name)
        if quartiles is not None:
            spread[name] = [round(quartiles[0], 4), round(quartiles[2], 4)]
    return spread


def format_speedup(value: float | None, iqr: list[float] | None) -> str:
    """A table cell: the speedup, then the middle half of its per-round ratios, "1.036 (1.021-1.048)"."""
    if value is None:
        return "-"
    if not iqr:
        return f"{value:#.4g}"
    return f"{value:#.4g} ({iqr[0]:#.4g}-{iqr[1]:#.4g})"  # "#": 4.000, not 4


class _CudaClock:
    def __init__(self, device: torch.device):
        self.device = device

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end)


class _WallClock:
    def settle(self) -> None:
        pass  # CPU collectives (gloo) and matmuls have finished when they return

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return (end - start) * 1e3


def round_order(round_index: int, n: int) -> list[int]:
    """The order of n variants in a round: row round_index of a Williams design, the balanced
    Latin square 0, 1, n-1, 2, n-2, ... shifted by the round (reversed in every other block of n
    rounds when n is odd, which alone leaves it unbalanced). The same on every rank."""
    if n <= 0:
        return []
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = [(v + round_index) % n for v in first]
    if n % 2 and (round_index // n) % 2:
        row.reverse()
    return row


def graphed(call):
    """`call` captured in a CUDA graph after two warm-up calls (compiles, allocates workspaces)
    on a side stream; returns the replay. Every rank captures the same variants in the same order
    (captured NCCL collectives must match across ranks). A replay costs a few microseconds of
    host time, so kernels shorter than an eager call's host time are timed by the GPU, not the host."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()

    def replay():
        graph.replay()

    replay.call = call  # the graph reads and writes what `call` holds (workspaces known by address only)
    return replay


def _barrier(info: GroupInfo) -> None:
    if info.group is not None:
        dist.barrier(group=info.group)


@dataclass(frozen=True)
class Timings:
    """What measure_rounds found: `ms` per variant (protocol step 5), and per round the slowest
    rank's ms per call of every variant (`rounds[name][r]`), for ratios paired within a round."""

    ms: dict[str, float]
    rounds: dict[str, list[float]]

    def ratio_quartiles(self, numerator: str, denominator: str) -> tuple[float, float, float] | None:
        """Quartiles (p25, median, p75) over the rounds of rounds[numerator][r] / rounds[denominator][r].

        A round's samples run back to back, so slow drift (clocks, a neighbour's load) cancels in
        its ratio: the spread of these ratios says how far one run's speedup can be trusted (on
        2x H200 two variants running the same code differed by up to 4% in ratio of medians)."""
        pairs = [a / b for a, b in zip(self.rounds[numerator], self.rounds[denominator], strict=True) if b > 0]
        if not pairs:
            return None
        if len(pairs) == 1:
            return pairs[0], pairs[0], pairs[0]
        p25, p50, p75 = statistics.quantiles(pairs, n=4, method="inclusive")
        return p25, p50, p75


def measure(
    variants: Sequence[Variant],
    protocol: Protocol,
    info: GroupInfo,
    device: torch.device,
    on_round: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Milliseconds per call of each variant: median over samples, then max over ranks.

    Every rank of `info` must call this with the same variant names in the same order
    (the barriers and the final reduction are collective). `on_round` is called after each
    measured round (a progress bar).
    """
    return measure_rounds(variants, protocol, info, device, on_round).ms


def measure_rounds(
    variants: Sequence[Variant],
    protocol: Protocol,
    info: GroupInfo,
    device: torch.device,
    on_round: Callable[[], None] | None = None,
) -> Timings:
    """measure(), keeping every round's time (the slowest rank's) beside the medians."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    device = torch.device(device)
    clock = _CudaClock(device) if device.type == "cuda" else _WallClock()
    next_call = {v.name: 0 for v in variants}

    def sample(variant: Variant):
        clock.settle()
        _barrier(info)  # untimed: every rank starts the sample together
        start = clock.mark()
        for _ in range(protocol.calls_per_sample):
            variant.calls[next_call[variant.name] % len(variant.calls)]()
            next_call[variant.name] += 1
        return start, clock.mark()

    def in_turn(round_index: int) -> list[Variant]:
        return [variants[i] for i in round_order(round_index, len(variants))]

    for r in range(protocol.warmup_rounds):
        for variant in in_turn(r):
            sample(variant)
    marks: dict[str, list] = {name: [] for name in names}
    for r in range(protocol.rounds):
        for variant in in_turn(r):
            marks[variant.name].append(sample(variant))
        if on_round is not None:
            on_round()
    clock.settle()
    calls = protocol.calls_per_sample
    per_call = [[clock.elapsed_ms(start, end) / calls for start, end in marks[name]] for name in names]
    medians = [statistics.median(samples) for samples in per_call]
    # One collective for both: each variant's median, then every sample, maximized over the ranks.
    slowest = max_over_ranks(medians + [t for samples in per_call for t in samples], info, device)
    rounds = protocol.rounds
    return Timings(
        ms=dict(zip(names, slowest[: len(names)], strict=True)),
        rounds={name: slowest[len(names) + i * rounds : len(names) + (i + 1) * rounds] for i, name in enumerate(names)},
    )


# measure_sustained waits for its queued calls about this often (a gap of a few microseconds each).
SUSTAINED_BATCH_SECONDS = 0.02


@dataclass(frozen=True)
class Spell:
    """One variant alone for a while (measure_sustained): ms a call, and the median SM clock (MHz)
    and power draw (W) read meanwhile (None where nvidia-smi could not)."""

    ms: float
    sm_mhz: float | None
    watts: float | None


def measure_sustained(variants: Sequence[Variant], seconds: float, spells: int, device: torch.device,
                      gpu: str | None = None) -> dict[str, list[Spell]]:  # fmt: skip
    """Protocol step 8 (one process, no group): each variant alone for `seconds` of back-to-back
    calls, `spells` times, in turn (odd passes in reverse order, so neither of two variants always
    follows the other); per variant its spells. `gpu`: nvidia-smi's id of the device (an index or
    UUID; the first GPU it lists if None)."""
    if seconds <= 0 or spells < 1:
        raise ValueError(f"need seconds > 0 and spells >= 1, got {seconds} and {spells}")
    device = torch.device(device)
    clock = _CudaClock(device) if device.type == "cuda" else _WallClock()
    out: dict[str, list[Spell]] = {v.name: [] for v in variants}
    for spell in range(spells):
        for variant in variants if spell % 2 == 0 else variants[::-1]:
            for call in variant.calls:  # warm: the previous variant's queue drained, caches its own
                call()
            clock.settle()
            calls, batch = 0, len(variant.calls) * 8
            with ClockSampler(gpu) as sampler:
                start, began = clock.mark(), time.perf_counter()
                while time.perf_counter() - began < seconds:
                    queued = time.perf_counter()
                    for _ in range(batch):
                        variant.calls[calls % len(variant.calls)]()
                        calls += 1
                    clock.settle()  # bounds the queue, so that the spell ends when its time is up
                    if time.perf_counter() - queued < SUSTAINED_BATCH_SECONDS:
                        batch *= 2  # batches this long keep the GPU's idle gaps negligible
                end = clock.mark()
                clock.settle()
            out[variant.name].append(Spell(clock.elapsed_ms(start, end) / calls, *sampler.medians()))
    return out
