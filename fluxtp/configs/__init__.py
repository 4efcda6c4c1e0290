"""Launch configs of the fused kernels (product side): the config dataclasses with their
heuristic and the tuner's search space (_classes), and the tuned tables with their lookup
(_table; the shipped table is default.json beside this file, package data).

The backends import this package; fluxtp.tune (the tuner and its CLI) imports it too, never the
other way around.
"""

from fluxtp.configs._classes import (
    ALL_REDUCE_ONE_SHOT_MAX_BYTES,
    FUSED_OPS,
    HOPPER_SMS,
    MIN_COPY_ENGINE_TILES,
    REDUCER_MIN_WORK,
    SMEM_LIMIT_BYTES,
    SMEM_RESERVE_BYTES,
    TRANSPORTS,
    AllGatherMatmulConfig,
    AllReduceConfig,
    GemmTiling,
    MatmulAllReduceConfig,
    MatmulReduceScatterConfig,
    all_reduce_one_shot_max_bytes,
    by_ranks,
    candidates,
    cdiv,
    config_class,
    describe,
    fits,
    heuristic,
    narrow_tiles_win,
    search_space,
    smem_bytes,
)
from fluxtp.configs._table import (
    GEMM_ONLY_MODE,
    WEIGHT_LAYOUTS,
    Choice,
    Entry,
    Key,
    choose,
    key_dtype,
    load,
    m_bucket,
    measured_verdict,
    reload,
    tuned_config,
    weight_layout_of,
)

__all__ = [
    "ALL_REDUCE_ONE_SHOT_MAX_BYTES", "FUSED_OPS", "GEMM_ONLY_MODE", "HOPPER_SMS", "MIN_COPY_ENGINE_TILES",
    "REDUCER_MIN_WORK", "SMEM_LIMIT_BYTES", "SMEM_RESERVE_BYTES", "TRANSPORTS", "WEIGHT_LAYOUTS",
    "AllGatherMatmulConfig", "AllReduceConfig", "Choice", "Entry", "GemmTiling", "Key", "MatmulAllReduceConfig",
    "MatmulReduceScatterConfig", "all_reduce_one_shot_max_bytes", "by_ranks", "candidates", "cdiv", "choose",
    "config_class", "describe", "fits", "heuristic", "key_dtype", "load", "m_bucket", "measured_verdict",
    "narrow_tiles_win", "reload", "search_space", "smem_bytes", "tuned_config", "weight_layout_of",
]  # fmt: skip
