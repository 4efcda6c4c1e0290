"""Host-held gates for one-GPU tests of the fused kernels' waits: a copy stream queues each
delivery (rows or a partial tile, then its flag) behind a gate word in host-pinned memory, and
the host opens the gates one by one while the kernel waits. The GPU's front end polls the words
(cuStreamWaitValue32), so the delay needs no SM, unlike a sleep kernel, which may not get one
beside a persistent GEMM that holds every SM."""

from __future__ import annotations

import time

import torch

from fluxtp import _driver


class HostGates:
    """`count` gates in pinned host memory, queued in order by hold() and opened by open_slowly()."""

    def __init__(self, count: int):
        self.words = torch.zeros(count, dtype=torch.int32, pin_memory=True)
        self.queued = 0

    def hold(self, gate: int | None = None) -> None:
        """The current stream's later work waits until gate `gate` opens (default: the next gate
        not queued yet; a queued gate may be waited on again, e.g. by a second recording)."""
        if gate is None:
            if self.queued >= self.words.numel():
                raise ValueError(f"only {self.words.numel()} gates")
            gate, self.queued = self.queued, self.queued + 1
        elif not 0 <= gate < self.queued:
            raise ValueError(f"gate {gate} is not queued yet ({self.queued} are)")
        stream = torch.cuda.current_stream().cuda_stream
        _driver.stream_wait_value32(stream, self.words.data_ptr() + self.words.element_size() * gate, 1)

    def open_slowly(self, kernel_done: torch.cuda.Event, delay_s: float, what: str) -> None:
        """Open the queued gates one by one, `delay_s` apart; before the last one, the kernel
        (whose end `kernel_done` marks) must still be waiting. Every gate is open on return."""
        try:
            for gate in range(self.queued):
                time.sleep(delay_s)
                if gate == self.queued - 1:
                    assert not kernel_done.query(), f"{what}: the kernel finished before the last delivery"
                self.words[gate] = 1
        finally:
            self.words.fill_(1)  # never leave a stream waiting
