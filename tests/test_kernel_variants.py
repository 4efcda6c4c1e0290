"""The one-GPU part-by-part benchmarks rewrite the fused kernels' source: every replacement of
every variant must still match the shipped kernel exactly once (else a benchmark would time the
shipped kernel under another name), and the result must still be valid Python."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

variants = importlib.import_module("_kernel_variants")


@pytest.mark.parametrize("script, kernel_file", [("all_gather_parts", "_all_gather_matmul.py"),
                                                     ("reduce_scatter_parts", "_matmul_reduce_scatter.py"),
                                                     ("reducer_parts", "_matmul_reduce_scatter_reducer.py")])
def test_every_variant_applies_to_the_shipped_kernel(script, kernel_file):
    module = importlib.import_module(script)
    shipped = (variants.KERNELS / kernel_file).read_text()
    for name, replacements in module.VARIANTS.items():
        source = variants.variant_source(shipped, name, replacements)
        assert source != shipped, name
        ast.parse(source)


def test_the_scale_load_variants_apply_to_both_warp_specialized_kernels():
    module = importlib.import_module("scale_loads")
    for op, (*_, kernel_file, op_variants) in module.OPS.items():
        assert set(op_variants) == set(module.VARIANTS), op
        shipped = (variants.KERNELS / kernel_file).read_text()
        for name, replacements in op_variants.items():
            source = variants.variant_source(shipped, f"{op} {name}", replacements)
            assert source != shipped, name
            ast.parse(source)


def test_the_timeline_stamps_apply_to_the_shipped_kernel():
    timeline = importlib.import_module("reducer_timeline")
    shipped = (variants.KERNELS / timeline.KERNEL_FILE).read_text()
    ast.parse(variants.variant_source(shipped, "stamped", timeline.stamps(0x7F0000000000)))
    slots = list(timeline.EVENTS.values())
    assert len(set(slots)) == len(slots) and max(slots) < timeline.SLOTS


def test_a_replacement_that_no_longer_matches_stops_the_benchmark():
    with pytest.raises(SystemExit, match="update this benchmark"):
        variants.variant_source("a = 1\n", "broken", [("b = 2", "b = 3")])
