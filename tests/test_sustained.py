"""The sustained-spell protocol (fluxtp.bench.harness.measure_sustained) and the GPU-state reader
beside it (fluxtp.bench.gpu_state), on CPU: nvidia-smi is stood in for where a test needs readings."""

import subprocess

import pytest
import torch

from fluxtp.bench import gpu_state, harness
from fluxtp.bench.harness import Variant, measure_sustained


def test_a_sample_line_parses_to_mhz_and_watts_and_anything_else_to_none():
    assert gpu_state.parse_sample("1410, 692.31") == (1410.0, 692.31)
    assert gpu_state.parse_sample("[N/A], 690.0") is None
    assert gpu_state.parse_sample("1410") is None


def test_without_nvidia_smi_every_reading_is_none(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert gpu_state.snapshot() == "nvidia-smi not available"
    with gpu_state.ClockSampler(interval=0.001) as sampler:
        pass
    assert sampler.samples == [] and sampler.medians() == (None, None)


def test_the_sampler_keeps_the_settled_samples_medians(monkeypatch):
    readings = iter(["1980, 300.0", "1500, 700.0", "1400, 690.0", "1410, 691.0", "1420, 692.0", "1400, 690.0"])

    def query(fields, gpu=None):
        assert fields == gpu_state.SAMPLE_FIELDS and gpu == "GPU-x"
        return next(readings, None)  # the stand-in runs out: the sampler stops

    monkeypatch.setattr(gpu_state, "_query", query)
    with gpu_state.ClockSampler("GPU-x", interval=0.0) as sampler:
        sampler._thread.join(timeout=5)
    assert len(sampler.samples) == 6
    assert sampler.medians() == (1405.0, 690.5)  # the first third (the clock settling) left out
    assert sampler.medians(settle=0) == (1415.0, 690.5)


def test_spells_alternate_their_order_and_time_every_call(monkeypatch):
    monkeypatch.setattr(harness, "SUSTAINED_BATCH_SECONDS", 0.0)  # no batch doubling: counts stay small
    monkeypatch.setattr(gpu_state, "_query", lambda fields, gpu=None: "1400, 690.0")
    order, calls = [], {"a": 0, "b": 0}

    class Sampler(gpu_state.ClockSampler):
        def __enter__(self):
            order.append(None)  # a spell starts: its first call names it
            return super().__enter__()

    monkeypatch.setattr(harness, "ClockSampler", Sampler)

    def call(name):
        def run():
            calls[name] += 1
            if order and order[-1] is None:
                order[-1] = name
        return run

    variants = [Variant("a", (call("a"), call("a"))), Variant("b", (call("b"),))]
    spells = measure_sustained(variants, 0.01, 3, torch.device("cpu"))
    assert order == ["a", "b", "b", "a", "a", "b"]  # every other pass reversed
    assert list(spells) == ["a", "b"] and all(len(v) == 3 for v in spells.values())
    for spell in spells["a"] + spells["b"]:
        assert spell.ms > 0 and spell.sm_mhz in (None, 1400.0) and spell.watts in (None, 690.0)
    assert calls["a"] >= 3 * (2 + 16) and calls["b"] >= 3 * (1 + 8)  # a warm call per input copy, then batches


@pytest.mark.parametrize("seconds, spells", [(0, 3), (1.0, 0)])
def test_spells_need_time_and_a_count(seconds, spells):
    with pytest.raises(ValueError, match="seconds > 0 and spells >= 1"):
        measure_sustained([Variant("a", (lambda: None,))], seconds, spells, torch.device("cpu"))
