"""The tuned-config tables and their lookup: what config a fused call launches, and whether "auto"
takes the fused op where a tuning measured it (the product side of `fluxtp tune`, which writes
the tables; the file format and the lookup order are in fluxtp/tune.py's docstring).

Tables are read when first needed and kept for the life of the process: a call costs no file
access. `reload()` re-reads them (after `fluxtp tune` or a copy rewrote a file, or after changing
FLUXTP_CACHE_DIR) and drops every cached call plan (fluxtp.ops); the tuner's own writes
(fluxtp.tune.write_entries) reload by themselves. `load` and `choose`, the tooling's views of a
file, read it afresh (by its modification time, size and inode).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fluxtp import _generation
from fluxtp.configs._classes import FUSED_OPS, TABLE_OPTIONAL, config_class, heuristic

SCHEMA = "fluxtp.tune/1"
CACHE_FILE = "configs.json"
# The shipped table: package data of fluxtp (pyproject.toml's package-data ships it).
SHIPPED_RESOURCE = ("configs", "default.json")
SHIPPED_TABLE: str | None = None  # another file instead of the package's (tests); None: the package's
USER_CACHE, SHIPPED, HEURISTIC = "user cache", "shipped table", "heuristic"
# What a shipped entry must record of its measurement (rank_tune writes all of these).
KEY_FIELDS = ("gpu", "world", "dtype", "op", "N", "K", "M_bucket", "weight_layout")
WEIGHT_LAYOUTS = ("linear", "transposed")
GEMM_ONLY_MODE = "gemm_only"  # measured["mode"] of an entry tuned on one GPU (fluxtp tune --one-gpu)


class CacheWarning(UserWarning):
    """The config cache file was ignored (unreadable, corrupt or stale)."""


class CacheFileError(ValueError):
    """Why a cache file's content cannot be used."""



# ---------------------------------------------------------------- the cache file


def cache_dir() -> Path:
    """$FLUXTP_CACHE_DIR, else $XDG_CACHE_HOME/fluxtp, else ~/.cache/fluxtp."""
    return Path(_cache_file(os.environ.get("FLUXTP_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"))).parent


def cache_path() -> Path:
    return Path(_cache_file(os.environ.get("FLUXTP_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME")))


@functools.lru_cache(maxsize=16)
def _cache_file(env_dir: str | None, xdg: str | None) -> str:
    if env_dir:
        base = Path(env_dir).expanduser()
    else:
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "fluxtp"
    return str(base / CACHE_FILE)


@functools.lru_cache(maxsize=1)
def _package_table() -> str:
    from importlib.resources import files

    resource = files("fluxtp")
    for part in SHIPPED_RESOURCE:
        resource = resource / part
    return str(resource)


def shipped_path() -> Path:
    """The shipped table: fluxtp/configs/default.json of the installed package (or SHIPPED_TABLE)."""
    return Path(SHIPPED_TABLE if SHIPPED_TABLE is not None else _package_table())


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (1, 2, 4, ...)."""
    return 1 << max(0, int(m) - 1).bit_length()


@dataclass(frozen=True)
class Key:
    gpu: str
    world: int
    dtype: str
    op: str
    N: int
    K: int
    M_bucket: int
    weight_layout: str = "linear"


def weight_layout_of(weight: torch.Tensor) -> str:
    """"transposed" for the backward's W^T view (strides (1, n)), else "linear"."""
    return "transposed" if weight.stride(0) == 1 and weight.stride(-1) != 1 else "linear"


@dataclass(frozen=True)
class Entry:
    key: Key
    config: object
    measured: dict


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(op: str, data) -> object:
    """The op's config from a cache entry; CacheFileError on a missing, unknown or mistyped field."""
    cls = config_class(op)
    if not isinstance(data, dict):
        raise CacheFileError(f"a config of {op} is not an object: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    optional = {name for name, f in fields.items() if f.metadata.get(TABLE_OPTIONAL)}
    unknown, missing = sorted(set(data) - set(fields)), sorted(set(fields) - set(data) - optional)
    if unknown:
        raise CacheFileError(f"unknown config field(s) {', '.join(unknown)} for {op} (written by another fluxtp?)")
    if missing:
        raise CacheFileError(f"config field(s) {', '.join(missing)} missing for {op} (written by another fluxtp?)")
    defaults = cls()
    for name, value in data.items():
        want = type(getattr(defaults, name))
        if type(value) is not want or (want is int and value <= 0):
            raise CacheFileError(f"config field {name}={value!r} of {op} is not a positive {want.__name__}")
    try:
        return cls(**data)
    except ValueError as e:  # the config's own checks
        raise CacheFileError(f"config of {op}: {e}") from None


def parse(text: str) -> dict[Key, Entry]:
    """The entries of a cache file's text; CacheFileError says why it cannot be used."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CacheFileError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise CacheFileError(f"schema {schema!r}, this fluxtp reads {SCHEMA!r}")
    if not isinstance(data.get("entries"), list):
        raise CacheFileError("no list of entries")
    entries: dict[Key, Entry] = {}
    for item in data["entries"]:
        required = KEY_FIELDS[:-1]  # weight_layout may be absent: "linear"
        if not isinstance(item, dict) or not set(required) | {"config"} <= set(item):
            raise CacheFileError(f"an entry lacks some of {', '.join(required)}, config: {item!r}")
        key = Key(**{f: item[f] for f in required}, weight_layout=item.get("weight_layout", "linear"))
        for f in ("world", "N", "K", "M_bucket"):
            if type(getattr(key, f)) is not int or getattr(key, f) <= 0:
                raise CacheFileError(f"entry {key}: {f} is not a positive integer")
        if not all(isinstance(getattr(key, f), str) for f in ("gpu", "dtype", "op")):
            raise CacheFileError(f"entry {key}: gpu, dtype and op must be strings")
        if key.op not in FUSED_OPS:
            raise CacheFileError(f"entry {key}: unknown op {key.op!r}")
        if key.weight_layout not in WEIGHT_LAYOUTS:
            raise CacheFileError(f"entry {key}: weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}")
        if key in entries:
            raise CacheFileError(f"two entries for {key}")
        measured = item.get("measured", {})
        entries[key] = Entry(key, config_from_dict(key.op, item["config"]), measured if isinstance(measured, dict) else {})
    return entries


def dumps(entries) -> str:
    """A cache file's text for these entries (sorted, so rewrites diff well)."""
    items = sorted(entries, key=lambda e: tuple(getattr(e.key, f) for f in KEY_FIELDS))
    rows = [{**dataclasses.asdict(e.key), "config": config_to_dict(e.config), "measured": e.measured} for e in items]
    return json.dumps({"schema": SCHEMA, "entries": rows}, indent=1) + "\n"


def _signature(path: str):
    """(mtime, size, inode) of the file, None when it does not exist or cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=8)
def _load_version(path: str, signature, shipped: bool = False) -> tuple[dict[Key, Entry], str | None]:
    """The entries of one version of the file (the signature names the version), or ({}, why it
    was ignored); the one warning per version is issued here, once."""
    try:
        text = Path(path).read_text()
        return parse(text), None
    except (OSError, UnicodeDecodeError, CacheFileError) as e:
        problem = str(e) if isinstance(e, CacheFileError) else f"cannot read it ({e})"
    if shipped:
        message = (
            f"fluxtp: ignoring the config table shipped with fluxtp, {path}: {problem}; calls use the user's "
            "cache or the heuristic configs (reinstall fluxtp)"
        )
    else:
        message = (
            f"fluxtp: ignoring the config cache {path}: {problem}; calls use the shipped table or the heuristic "
            "configs (rerun `fluxtp tune` or delete the file)"
        )
    warnings.warn(message, CacheWarning, stacklevel=2)
    return {}, problem


def load(path: str | os.PathLike | None = None, *, shipped: bool = False) -> tuple[dict[Key, Entry], str | None]:
    """(entries, None), or ({}, why the file was ignored); ({}, None) when there is no file.
    `path` defaults to the user's cache, or with shipped=True to the shipped table."""
    if path is None:
        path = shipped_path() if shipped else cache_path()
    path = str(path)
    signature = _signature(path)
    if signature is None:
        return {}, None
    return _load_version(path, signature, shipped)


@dataclass(frozen=True)
class Choice:
    """The config a call would use, and why."""

    config: object
    source: str  # how it was found: "exact", "nearest" or "heuristic"
    why: str
    entry: Entry | None = None
    origin: str = HEURISTIC  # which table answered: USER_CACHE, SHIPPED or HEURISTIC


def _find(entries: dict[Key, Entry], key: Key) -> tuple[Entry | None, str]:
    """The exact key, else the nearest M bucket; a transposed weight without an entry of its own
    layout then looks for the linear layout's."""
    layouts = dict.fromkeys([key.weight_layout, "linear"])
    for layout in layouts:
        wanted = dataclasses.replace(key, weight_layout=layout)
        if wanted in entries:
            return entries[wanted], "exact"
        same = [e for k, e in entries.items() if dataclasses.replace(k, M_bucket=key.M_bucket) == wanted]
        if same:
            target = math.log2(key.M_bucket)
            return min(same, key=lambda e: (abs(math.log2(e.key.M_bucket) - target), e.key.M_bucket)), "nearest"
    return None, "heuristic"


def _first_answer(tables, *key) -> tuple[Entry | None, str]:
    """The first answer of the tables ((path, signature, shipped), ...) for the key and how it was
    found, or (None, HEURISTIC). Not cached itself: _launch_entry keeps its answers."""
    for path, signature, shipped in tables:
        if signature is None:
            continue
        entries, _ = _load_version(path, signature, shipped)
        entry, source = _find(entries, Key(*key))
        if entry is not None:
            return entry, source
    return None, HEURISTIC


def choose(op, gpu, world, dtype, m_total, n, k, path=None, shipped_table=None, weight_layout="linear",
           warp_specialized: bool = False) -> Choice:  # fmt: skip
    """What a call of `op` with these global sizes would launch, and why (see the module doc):
    `path` is the user's cache (default: cache_path()), `shipped_table` the shipped table
    (default: shipped_path()); warp_specialized: the call may take the all-gather's
    warp-specialized kernel (the launcher's warp_specialized_runs), as its heuristic then does."""
    dtype = str(dtype).removeprefix("torch.")
    key = Key(gpu, world, dtype, op, n, k, m_bucket(m_total), weight_layout)
    tables = (
        (USER_CACHE, str(cache_path() if path is None else path), False),
        (SHIPPED, str(shipped_path() if shipped_table is None else shipped_table), True),
    )
    missing = []
    for origin, table_path, shipped in tables:
        entries, problem = load(table_path, shipped=shipped)
        entry, source = _find(entries, key)
        if entry is not None:
            if source == "exact":
                why = f"{origin}: exact key (M bucket {key.M_bucket})"
            else:
                why = f"{origin}: nearest M bucket {entry.key.M_bucket} (none for bucket {key.M_bucket})"
            if entry.key.weight_layout != weight_layout:
                why += f", from the {entry.key.weight_layout} layout (none tuned for {weight_layout})"
            if _gives_way(entry, m_total, n):
                why += ", whose tiles would leave this grid mostly idle: the heuristic's instead"
            return Choice(_as_launched(entry, m_total, n, world), source, why, entry, origin)
        if problem is not None:
            missing.append(f"the {'shipped table' if shipped else 'cache file'} is ignored ({problem})")
        elif _signature(table_path) is None:
            missing.append(f"no {'shipped table' if shipped else 'cache file'} at {table_path}")
        else:
            missing.append(f"no tuned entry in the {origin}")
    why = f"heuristic ({gpu} x{world} {dtype} N={n} K={k} {weight_layout}): " + "; ".join(missing)
    return Choice(heuristic(op, m_total, n, k, world, warp_specialized), "heuristic", why)


# float8: the FP8 ops' tilings (fluxtp tune --one-gpu), by accumulation (key_dtype).
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn"}  # fmt: skip
FAST_ACCUM_SUFFIX = "+fast_accum"


def key_dtype(dtype: str | None, fast_accum: bool = False) -> str | None:
    """A key's dtype: the operands' (bfloat16, float8_e4m3fn, ...), an FP8 call with fast
    accumulation's with FAST_ACCUM_SUFFIX (its tilings differ from a precise call's)."""
    return dtype + FAST_ACCUM_SUFFIX if fast_accum and dtype is not None else dtype


@functools.lru_cache(maxsize=64)
def _gpu_name(device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return device_type
    return torch.cuda.get_device_name(index)


# The versions (_signature) of the tables the launchers' lookup reads, fixed at their first use
# until reload(), and its answers per call signature: a call reads no file.
_table_versions: dict[str, tuple | None] = {}
_launch_answers: dict[tuple, tuple[Entry | None, str]] = {}
_MAX_LAUNCH_ANSWERS = 4096

def reload() -> None:
    """Read the tuning tables afresh at the next lookup, and drop every cached call plan.

    Call it on every rank at the same point (SPMD: the ranks must keep launching the same
    config), after a tuning table was rewritten or FLUXTP_CACHE_DIR / SHIPPED_TABLE changed."""
    _table_versions.clear()
    _launch_answers.clear()
    _generation.bump()  # every call plan resolved its config (and "auto" its backend) from them


def _version(path: str):
    """The version of `path` the lookup reads: the one seen first since the last reload()."""
    if path not in _table_versions:
        _table_versions[path] = _signature(path)
    return _table_versions[path]


def _launch_entry(op: str, x: torch.Tensor, weight: torch.Tensor, world: int,
                  fast_accum: bool = False) -> tuple[Entry | None, str]:  # fmt: skip
    """The entry the launchers' lookup answers with for this call, and how it was found
    ("exact", "nearest"), or (None, "heuristic"). x and weight are what the launcher holds:
    all_gather_matmul x_shard [M/W, K] and weight [N/W, K]; matmul_reduce_scatter x [M, K/W]
    and weight [N, K/W], in either layout (weight_layout_of); fast_accum: an FP8 call's
    (key_dtype). Reads the tables as they were at their first use (see reload()); never raises
    for a bad file (warns once)."""
    path = _cache_file(os.environ.get("FLUXTP_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"))
    shipped = SHIPPED_TABLE if SHIPPED_TABLE is not None else _package_table()
    call = (op, path, shipped, x.shape, x.dtype, x.device, weight.shape, weight.stride(), world, fast_accum)
    known = _launch_answers.get(call)
    if known is not None:
        return known
    tables = ((path, _version(path), False), (shipped, _version(shipped), True))
    answer = _find_launch_entry(op, x, weight, world, tables, fast_accum)
    if len(_launch_answers) >= _MAX_LAUNCH_ANSWERS:
        _launch_answers.clear()
    _launch_answers[call] = answer
    return answer


def _global_sizes(op: str, x: torch.Tensor, weight: torch.Tensor, world: int) -> tuple[int, int, int]:
    """The layer's global (M, N, K) from what the launcher holds (see _launch_entry)."""
    if op == "all_gather_matmul":
        return x.shape[0] * world, weight.shape[0] * world, x.shape[1]
    return x.shape[0], weight.shape[0], x.shape[1] * world


def _gives_way(entry: Entry, m_total: int, n: int) -> bool:
    """Whether a bf16 / fp16 reduce-scatter's entry tuned at another M bucket has tiles that leave
    this call's grid mostly idle (MatmulReduceScatterConfig.fits_grid)."""
    return (entry.key.op == "matmul_reduce_scatter" and entry.key.dtype in ("bfloat16", "float16")
            and entry.key.M_bucket != m_bucket(m_total) and not entry.config.fits_grid(m_total, n))  # fmt: skip


def _as_launched(entry: Entry, m_total: int, n: int, world: int):
    """An entry's config as a call launches it. An entry tuned on one GPU (GEMM-only) measured its
    tiling alone: it takes the heuristic's communication knobs of today, not those of its day. An
    entry that gives way (_gives_way) yields the heuristic."""
    if _gives_way(entry, m_total, n):
        return heuristic(entry.key.op, m_total, n, entry.key.K, world)
    if entry.measured.get("mode") != GEMM_ONLY_MODE:
        return entry.config
    if entry.key.op == "all_gather_matmul":
        return entry.config.with_communication_heuristic(m_total // world)
    return entry.config.with_communication_heuristic(m_total, n, world)


def _find_launch_entry(op: str, x: torch.Tensor, weight: torch.Tensor, world: int, tables,
                       fast_accum: bool) -> tuple[Entry | None, str]:  # fmt: skip
    if tables[0][1] is None and tables[1][1] is None:
        return None, HEURISTIC
    m_total, n, k = _global_sizes(op, x, weight, world)
    device = x.device
    gpu = _gpu_name(device.type, device.index)
    dtype = key_dtype(_DTYPE_NAMES.get(x.dtype), fast_accum)
    return _first_answer(tables, gpu, world, dtype, op, n, k, m_bucket(m_total), weight_layout_of(weight))


def tuned_config(op: str, x: torch.Tensor, weight: torch.Tensor, world: int, fast_accum: bool = False):
    """The launchers' lookup: the config of the user's cache or else of the shipped table for
    this call (see _launch_entry) as _as_launched gives it, or None (use the heuristic)."""
    entry, _ = _launch_entry(op, x, weight, world, fast_accum)
    if entry is None:
        return None
    m_total, n, _ = _global_sizes(op, x, weight, world)
    return _as_launched(entry, m_total, n, world)


# "auto" takes a fused op where its tuning measured it this much faster than NCCL, or more.
AUTO_WIN_RATIO = 0.95


def measured_verdict(op: str, x: torch.Tensor, weight: torch.Tensor, world: int) -> bool | None:
    """Whether the fused op was measured faster than NCCL-then-GEMM for this very call: True where
    the entry the launcher would use was tuned for exactly this key (M bucket and weight layout
    included) and recorded ms <= AUTO_WIN_RATIO x nccl_ms; False where it recorded ms > nccl_ms;
    None where there is no such entry, no nccl_ms, or the two are within the margin (too close
    to call from one measurement)."""
    entry, source = _launch_entry(op, x, weight, world)
    return _verdict(entry, source, weight_layout_of(weight))[0]


def _verdict(entry: Entry | None, source: str, layout: str) -> tuple[bool | None, float | None]:
    """(measured_verdict's answer, the measured speedup nccl_ms / ms) for a lookup's answer; (None,
    None) unless it is an exact entry of the call's layout with both times recorded."""
    if entry is None or source != "exact" or entry.key.weight_layout != layout:
        return None, None
    ms, nccl_ms = entry.measured.get("ms"), entry.measured.get("nccl_ms")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (ms, nccl_ms)):
        return None, None
    if ms <= AUTO_WIN_RATIO * nccl_ms:
        return True, nccl_ms / ms
    return (False if ms > nccl_ms else None), nccl_ms / ms

