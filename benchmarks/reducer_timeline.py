"""When each part of the reducer kernel happens, from %globaltimer stamps (GEMM-only mode, one GPU).

    python benchmarks/reducer_timeline.py [--models llama3-8b] [--worlds 8] [--tokens 1024,2048]
        [--dtype float8_e4m3fn] [--fast-accum] [--rounds 5] [--out FILE.json]

Per reduce-scatter case that a call runs on the reducer kernel
(fluxtp/kernels/_matmul_reduce_scatter_reducer.py): a copy of its source whose partitions write
the time of each event (EVENTS) into a table of int64 per (program, event) whose address is
compiled in, launched as the GEMM-only mode launches the shipped kernel. The shipped kernel, the
stamped copy and cuBLAS (torch._scaled_mm for FP8) are timed first, interleaved (what the stamps
cost); then one stamped launch gives, per event, the min / median / max over programs of
microseconds after the first program's consumer 0 started. Consumer stamps are consumer 0's
(and consumer 1's last own half), of its last tile; the reducer's are of its first UNITS units
beside the MMAs and of its first UNITS tail units (the tail: reducer_tail_units).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch
from tabulate import tabulate

import fluxtp.kernels._matmul_reduce_scatter_reducer as reducer_module
from fluxtp.bench.gemm_grid import relative_error
from fluxtp.bench.harness import graphed
from fluxtp.bench.results import command_line, envelope, write_json

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import time_case, variant_kernel  # noqa: E402
from reducer_parts import KERNEL, KERNEL_FILE, gemm_only_with, reducer_cases, reducer_parser  # noqa: E402

MAX_PROGRAMS = 256
SLOTS = 64  # events per program
UNITS = 5  # units stamped beside the MMAs (5 events each), and in the tail (3 each)
UNIT_EVENTS = ("waited for", "next unit's flags seen", "rows landed", "summed", "next unit requested")
EVENTS = {
    "consumer 0 starts": 30,
    "last K loop ends": 28,
    "last own half counted": 27,
    "consumer 1: last own half counted": 59,
    "consumer 0 done": 29,
    "reducer starts": 0,
    "first units requested": 1,
    **{f"unit {j}: {what}": 2 + 5 * j + k for j in range(UNITS) for k, what in enumerate(UNIT_EVENTS)},
    "tail: every partition done": 56,
    "tail: flags seen": 58,
    "tail: units requested": 57,
    **{f"tail unit {k}: {what}": 32 + 4 * k + i for k in range(UNITS)
       for what, i in (("requested", 2), ("landed", 0), ("summed", 1))},
    "program ends": 31,
    "kernel entered": 60,
    "kernel exits": 61,
}


def stamps(table_address: int) -> list[tuple[str, str]]:
    """The replacements that stamp EVENTS into the table at table_address."""
    helper = f'''

@gluon.jit
def _stamp(event):
    """The time into this program's row of the timeline table (compiled-in address)."""
    pid = gl.program_id(0)
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=gl.int64, is_pure=False, pack=1)
    gl.store((pid.to(gl.int64) * 0 + {table_address} + (pid * {SLOTS} + event).to(gl.int64) * 8).to(
        gl.pointer_type(gl.int64)), now)
'''
    return [
        ("REDUCE_WIDTH = gl.constexpr(256)  # columns a reduction step covers at most: 8 per lane, 16-byte accesses\n",
         "REDUCE_WIDTH = gl.constexpr(256)\n" + helper),
        ("        own_flags = _own_flags(buffer_ptrs, own_offset, RANK)\n        units = ",
         "        _stamp(0)\n        own_flags = _own_flags(buffer_ptrs, own_offset, RANK)\n        units = "),
        ("        phases = 0  # bit b", "        _stamp(1)\n        phases = 0  # bit b"),
        ("        for unit in range(pid, last, NUM_PROGRAMS):\n",
         "        for unit in range(pid, last, NUM_PROGRAMS):\n"
         f"            nth = unit // NUM_PROGRAMS\n            if nth < {UNITS}:\n                _stamp(2 + 5 * nth)\n"),
        ("            if row0 < rows_per_rank:\n                mbarrier.wait(unit_bar",
         f"            if nth < {UNITS}:\n                _stamp(3 + 5 * nth)\n"
         "            if row0 < rows_per_rank:\n                mbarrier.wait(unit_bar"),
        ("                phases ^= 1 << buffer\n",
         f"                phases ^= 1 << buffer\n                if nth < {UNITS}:\n                    _stamp(4 + 5 * nth)\n"),
        ("            if next_valid:\n                if UNITS_IN_FLIGHT > 1:",
         f"            if nth < {UNITS}:\n                _stamp(5 + 5 * nth)\n"
         "            if next_valid:\n                if UNITS_IN_FLIGHT > 1:"),
        ("            buffer = (buffer + 1) % UNITS_IN_FLIGHT\n",
         f"            if nth < {UNITS}:\n                _stamp(6 + 5 * nth)\n            buffer = (buffer + 1) % UNITS_IN_FLIGHT\n"),
        ("    tail_phase = 0\n", "    _stamp(56)\n    tail_phase = 0\n"),
        ("                    gave_up_lane = missing\n",
         "                    gave_up_lane = missing\n            _stamp(58)\n"),
        ("        for k in range(count):\n", "        _stamp(57)\n        for k in range(count):\n"),
        ("tail_bar.index(k), row0, pid_n * BLOCK_N, WORLD, PUSH)\n",
         "tail_bar.index(k), row0, pid_n * BLOCK_N, WORLD, PUSH)\n"
         f"                    if k < {UNITS}:\n                        _stamp(34 + 4 * k)\n"),
        ("            mbarrier.wait(tail_bar.index(k), tail_phase)\n",
         "            mbarrier.wait(tail_bar.index(k), tail_phase)\n"
         f"            if k < {UNITS}:\n                _stamp(32 + 4 * k)\n"),
        ("        tail_phase ^= 1\n",
         f"            if k < {UNITS}:\n                _stamp(33 + 4 * k)\n        tail_phase ^= 1\n"),
        ("    pending = 0  # a peer half stored", "    if C == 0:\n        _stamp(30)\n    pending = 0  # a peer half stored"),
        ("            if pending != 0:  # its store had",
         "            if C == 0:\n                _stamp(28)\n            if pending != 0:  # its store had"),
        ("                _count_own(own_flags + pid_m * tiles_n + pid_n)\n",
         "                _count_own(own_flags + pid_m * tiles_n + pid_n)\n                _stamp(27 + 32 * C)\n"),
        ("    if pending != 0:\n        handed = _hand_over_peer_half(stored, counted, handed)\n",
         "    if pending != 0:\n        handed = _hand_over_peer_half(stored, counted, handed)\n"
         "    if C == 0:\n        _stamp(29)\n"),
        ("    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)\n",
         "    _stamp(60)\n    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)\n"),
        ("            gl.atomic_xchg(done, 0, sem=\"relaxed\", scope=\"gpu\")\n",
         "            gl.atomic_xchg(done, 0, sem=\"relaxed\", scope=\"gpu\")\n    _stamp(61)\n"),
        ("    if RESET_OWN:\n", "    _stamp(31)\n    if RESET_OWN:\n"),
    ]


def timeline(table: torch.Tensor) -> dict[str, list[float]]:
    """EVENTS' [min, median, max] over the programs that stamped them, in us after the first start."""
    rows = [row for row in table.view(MAX_PROGRAMS, SLOTS).tolist() if row[EVENTS["consumer 0 starts"]]]
    start = min(row[EVENTS["consumer 0 starts"]] for row in rows)
    events = {}
    for name, slot in EVENTS.items():
        times = [(row[slot] - start) / 1000 for row in rows if row[slot]]
        if times:
            events[name] = [round(min(times), 2), round(statistics.median(times), 2), round(max(times), 2)]
    return events


def main() -> None:
    args = reducer_parser(__doc__, "llama3-8b", "1024,2048", {}).parse_args()
    if torch.cuda.get_device_properties().multi_processor_count > MAX_PROGRAMS:
        raise SystemExit(f"more SMs than the timeline table's {MAX_PROGRAMS} programs")
    table = torch.zeros(MAX_PROGRAMS * SLOTS, dtype=torch.int64, device="cuda")
    directory = Path(tempfile.mkdtemp(prefix="fluxtp-reducer-timeline-"))
    stamped = variant_kernel(KERNEL_FILE, KERNEL, "stamped", stamps(table.data_ptr()), directory)
    rows = []
    for case, x, w, scaled, config, reference, want in reducer_cases(args):
        runs = {}
        for name, kernel in (("fused", getattr(reducer_module, KERNEL)), ("stamped", stamped)):
            run = gemm_only_with(kernel, x, w, case.world, config, **scaled)
            if not relative_error(run(), want) < 2e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result")
            runs[name] = run
        row = time_case(case, {name: graphed(run) for name, run in runs.items()}, x, w, config, args.rounds,
                        reference, transport=config.transport)  # fmt: skip
        table.zero_()
        runs["stamped"]()
        torch.cuda.synchronize()
        row["events_us"] = timeline(table.cpu())
        rows.append(row)
        print(f"\n{case.label()}: fused {row['vs_cublas']['fused']:.3f}x cuBLAS, stamped "
              f"{row['vs_cublas']['stamped']:.3f}x; cuBLAS {row['ms']['cublas'] * 1000:.1f} us")
        print(tabulate([[name, *values] for name, values in row["events_us"].items()],
                       headers=["event (us)", "min", "median", "max"]))  # fmt: skip
        del runs
        torch.cuda.empty_cache()
    if args.out:
        data = envelope("reducer_timeline", rows, device=torch.cuda.get_device_name(), gpus=1, world=0,
                        command=command_line())  # fmt: skip
        print("wrote", write_json(data, args.out))


if __name__ == "__main__":
    main()
