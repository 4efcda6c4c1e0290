"""A GPU's SM clock and power draw as nvidia-smi reports them, read beside timings.

A power-capped GPU (an H200 at its 700 W) sets its SM clock by the power its kernels draw, so the
same kernel runs at different clocks beside different neighbours, and two kernels of equal time per
cycle can differ in time when each runs alone for long (docs/benchmarks.md). Where nvidia-smi is
missing or fails, every reading is None: the timings stand without it.
"""

from __future__ import annotations

import statistics
import subprocess
import threading

SNAPSHOT_FIELDS = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu"
SAMPLE_FIELDS = "clocks.sm,power.draw"


def _query(fields: str, gpu: str | None = None) -> str | None:
    """nvidia-smi's CSV line(s) for `fields` (no header, no units) of `gpu` (an index or UUID;
    every GPU if None), or None where it cannot answer."""
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    if gpu is not None:
        command.append(f"--id={gpu}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def smi_id(device) -> str | None:
    """nvidia-smi's id of a CUDA device ("GPU-<uuid>", whatever CUDA_VISIBLE_DEVICES renumbered),
    or None where nvidia-smi does not know it by that (queries then read the first GPU listed)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    gpu = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
    return gpu if _query("clocks.sm", gpu) is not None else None


def snapshot(gpu: str | None = None) -> str:
    """SNAPSHOT_FIELDS of `gpu` as one line of text (results files keep it as read)."""
    return _query(SNAPSHOT_FIELDS, gpu) or "nvidia-smi not available"


def parse_sample(line: str) -> tuple[float, float] | None:
    """(SM MHz, watts) from a SAMPLE_FIELDS line of one GPU; None if it is not two numbers."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:  # "[N/A]" on GPUs that do not report one
        return None


class ClockSampler:
    """Polls `gpu`'s SM clock and power draw every `interval` seconds in a thread while open:

        with ClockSampler(gpu) as sampler:
            ...  # the work
        mhz, watts = sampler.medians()
    """

    def __init__(self, gpu: str | None = None, interval: float = 0.05):
        self.gpu = gpu
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            line = _query(SAMPLE_FIELDS, self.gpu)
            sample = parse_sample(line.splitlines()[0]) if line else None
            if sample is None:
                return  # no nvidia-smi, or a GPU that does not report: nothing to read
            self.samples.append(sample)
            self._stop.wait(self.interval)

    def __enter__(self) -> ClockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def medians(self, settle: float = 1 / 3) -> tuple[float | None, float | None]:
        """Median SM MHz and watts over the samples after the first `settle` share (the clock
        settling after the previous work); (None, None) without samples."""
        kept = self.samples[int(len(self.samples) * settle):]
        if not kept:
            return None, None
        return statistics.median(s[0] for s in kept), statistics.median(s[1] for s in kept)
