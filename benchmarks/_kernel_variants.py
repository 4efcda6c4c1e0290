"""Copies of a fused kernel's source with parts switched off or changed, for one-GPU A/B runs.

A variant is a list of (old, new) text replacements, each of which must apply exactly: a
benchmark whose replacement no longer matches the kernel stops and says so, instead of timing
the shipped kernel under another name (tests/test_kernel_variants.py checks them on CPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

KERNELS = Path(__file__).parents[1] / "fluxtp" / "kernels"


def variant_source(source: str, name: str, replacements: list[tuple[str, str]]) -> str:
    """`source` with every replacement applied; SystemExit naming the first that does not match once."""
    for old, new in replacements:
        if source.count(old) != 1:
            raise SystemExit(f"{name}: the kernel contains {old!r} {source.count(old)} times, not once; update this benchmark")
        source = source.replace(old, new)
    return source


def variant_kernel(kernel_file: str, kernel_name: str, name: str, replacements: list[tuple[str, str]], directory: Path):
    """`kernel_name` compiled from fluxtp/kernels/`kernel_file` with the replacements applied."""
    source = variant_source((KERNELS / kernel_file).read_text(), name, replacements)
    module_name = f"_variant_{Path(kernel_file).stem}_{name}"
    path = directory / f"{module_name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton.jit reads the function's source through its module
    spec.loader.exec_module(module)
    return getattr(module, kernel_name)


@contextlib.contextmanager
def launching(launcher_module, kernel_name: str, kernel):
    """Within the block, `launcher_module` launches `kernel` in place of its shipped `kernel_name`."""
    shipped = getattr(launcher_module, kernel_name)
    setattr(launcher_module, kernel_name, kernel)
    try:
        yield
    finally:
        setattr(launcher_module, kernel_name, shipped)
