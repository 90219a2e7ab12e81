"""Compiled twins of the controller's hot loops: ``_native.c``, built on first use, via ctypes.

The planner runs once per MoE layer call on every rank, so its cost is pure overhead; at EP 64
its Python loops (placement greedies, the exact assignment's augmenting paths, holder
bookkeeping) took hundreds of microseconds. ``_native.c`` mirrors those routines move for move
(same names), so plans are bit-identical; the Python implementations stay as the reference and
the fallback (tests/test_control_native.py compares both).

Build: on first use the system C compiler (``$CC``, else ``cc``, else ``gcc``) compiles the
source into ``$LRMOE_CACHE_DIR`` (default ``~/.cache/megatron_lrmoe``), the file name keyed by a
hash of the source, the compiler and its version and the flags; it compiles to a temporary file
and renames it into place, so ranks building at once are safe. Without a compiler, or when the
build or the load fails, :func:`library` logs one warning and returns None, and every caller
takes its Python path. ``LRMOE_NATIVE=0`` forces the Python path (read at every call).

Shape legend as in controller.py: P ranks, E experts, M replicated experts (items), K holder
entries. Every array crossing the boundary is C-contiguous int64 (or numpy bool / uint8).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron_lrmoe.control.slots import LinearSlots

__all__ = [
    "NativeError",
    "best_fit_greedy",
    "build",
    "caps_cut",
    "library",
    "min_max",
    "place_search",
    "reset",
    "threshold_greedy",
]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_native.c")
# -ffp-contract=off: no fused multiply-add, so any float step rounds as numpy's does.
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off")
LIBS = ("-lm",)

# Return codes of _native.c.
OK, NONE, NOMEM, ASSERT = 0, 1, -1, -2
# lrmoe_greedy returns a move count, so its codes are negative: -1 the greedy failed, -2 NOMEM.
GREEDY_FAILED, GREEDY_NOMEM = -1, -2

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Argument types of every exported function (pointers as addresses).
_SIGNATURES: dict[str, tuple[object, tuple[object, ...]]] = {
    "lrmoe_greedy": (_I, (_I, _I, _P, _P, _P, _I, _P, _INT, _P)),
    "lrmoe_place_search_packed": (_INT, (ctypes.c_char_p,)),
    "lrmoe_place_call": (_INT, (ctypes.c_char_p,)),
    "lrmoe_min_max": (_INT, (_I, _I, _P, _P, _P, _P, _P, _P, _P, _P)),
    "lrmoe_caps_cut": (_I, (_I, _I, _P, _P, _P, _P, _P, _P, _P, _P)),
    "lrmoe_backward": (_INT, (ctypes.c_char_p,)),
    "lrmoe_start_caps_cut": (_I, (ctypes.c_char_p,)),
    "lrmoe_start": (None, (_I, _I, _P, _P, _P, _I, _P, _P, _P, _INT, _P, _P)),
    "lrmoe_counts": (_INT, (ctypes.c_char_p,)),
}
# The per-call functions take their arguments packed in one block of 8-byte fields (ctypes
# converts each declared argument on its own, about 0.4 us each here: 9 us for 23 arguments,
# 1.3 us for one packed block); ``q`` an integer or an address, ``d`` a float, in the order of
# the C parameters (see the packed entry points at the end of _native.c).
PLACE_CALL = struct.Struct("@9qd18q")
BACKWARD = struct.Struct("@15q")
START_CAPS_CUT = struct.Struct("@13q")
PLACE_SEARCH = struct.Struct("@8qd3q")
COUNTS = struct.Struct("@3q3d2q")


class NativeError(RuntimeError):
    """The compiled code reported an error (out of memory, or a broken internal invariant)."""


class _State:
    """The loaded library, or why there is none (tried once per process)."""

    tried = False
    lib: Optional[ctypes.CDLL] = None


def library() -> Optional[ctypes.CDLL]:
    """The compiled library, building it on first use; None when ``LRMOE_NATIVE=0`` or when it
    cannot be built or loaded (then one warning, and callers use their Python paths)."""
    if os.environ.get("LRMOE_NATIVE", "1") == "0":
        return None
    if not _State.tried:
        _State.tried = True
        try:
            _State.lib = _load(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning(
                "megatron_lrmoe: the planner's native code is unavailable (%s); using the "
                "Python planner (same plans, slower). Set LRMOE_NATIVE=0 to silence this.",
                e,
            )
    return _State.lib


def reset() -> None:
    """Forget the loaded library so the next :func:`library` call builds or loads it again
    (tests simulate a missing compiler this way)."""
    _State.tried, _State.lib = False, None


def compiler() -> str:
    """The C compiler to use: ``$CC``, else ``cc``, else ``gcc`` (RuntimeError if none)."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    raise RuntimeError("no C compiler found ($CC, cc, gcc)")


def cache_dir() -> Path:
    """Where built libraries live: ``$LRMOE_CACHE_DIR`` or ``~/.cache/megatron_lrmoe``."""
    return Path(os.environ.get("LRMOE_CACHE_DIR") or Path.home() / ".cache" / "megatron_lrmoe")


def build() -> Path:
    """Compile ``_native.c`` unless a library built from the same source, compiler and flags is
    cached; returns its path. Safe when several processes build at once (atomic rename)."""
    cc = compiler()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    source = SOURCE.read_bytes()
    parts = [source, cc.encode(), version.encode(), *(flag.encode() for flag in FLAGS + LIBS)]
    key = hashlib.sha256(b"\0".join(parts))
    target = cache_dir() / f"lrmoe_native_{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".lrmoe_native_", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE), *LIBS],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed ({result.returncode}): {result.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def check(status: int) -> int:
    """Raise :class:`NativeError` for the C error codes; pass the others through."""
    if status == NOMEM:
        raise NativeError("out of memory in the planner's native code")
    if status == ASSERT:
        raise AssertionError("a failed probe must prove a bound (native min_max)")
    return status


def address(array: np.ndarray) -> int:
    """The data address of a C-contiguous array (never a temporary copy, which could be freed
    before the call reads it). Through ctypes' buffer protocol where the array is writable:
    about a third of the cost of ``array.ctypes.data`` (2.4 us here), which adds up over the
    dozen pointers of a plan."""
    flags = array.flags
    assert flags.c_contiguous, "native arguments must be C-contiguous"
    if flags.writeable and array.size:
        return _addressof(_from_buffer(array))
    return array.ctypes.data


_addressof, _from_buffer = ctypes.addressof, ctypes.c_char.from_buffer


def _i64(values: object) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


# --------------------------------------------------------------------------------------------- #
# Placement (placement.py's twins)
# --------------------------------------------------------------------------------------------- #


def _greedy_run(
    lib: ctypes.CDLL,
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
    use_best_fit: bool,
) -> Optional[list[tuple[int, int, int]]]:
    loads, ranks, free = _i64(expert_load), _i64(rank_load), _i64(slots)
    num_ranks = ranks.size
    hot = _i64(experts_hot_first).reshape(num_ranks, -1) if num_ranks else _i64([])
    local = hot.shape[1] if num_ranks else 0
    moves = np.empty(3 * max(loads.size * num_ranks, 1), dtype=np.int64)
    count = lib.lrmoe_greedy(
        num_ranks,
        local,
        address(loads),
        address(ranks),
        address(hot),
        int(threshold),
        address(free),
        int(use_best_fit),
        address(moves),
    )
    if count == GREEDY_NOMEM:
        raise NativeError("out of memory in the planner's native code")
    if count == GREEDY_FAILED:
        return None
    return [tuple(m) for m in moves[: 3 * count].reshape(-1, 3).tolist()]


def threshold_greedy(
    lib: ctypes.CDLL,
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """``placement.threshold_greedy`` in C (every rank owns the same number of experts)."""
    return _greedy_run(lib, expert_load, rank_load, experts_hot_first, threshold, slots, False)


def best_fit_greedy(
    lib: ctypes.CDLL,
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """``placement.best_fit_greedy`` in C."""
    return _greedy_run(lib, expert_load, rank_load, experts_hot_first, threshold, slots, True)


SlotRule = tuple[Optional[np.ndarray], int, int, int, bool]


def slot_rule(slots: object, num_ranks: int) -> Optional[SlotRule]:
    """The C form of a placement's slots, ``(room [P] or None, per_pair, replica_bytes, limit,
    linear)`` (see ``slots_at`` in _native.c), or None for a rule C does not evaluate (an
    arbitrary callable)."""
    if isinstance(slots, int):
        return None, 0, 1, slots, False  # ``slots`` on every rank
    if isinstance(slots, LinearSlots):
        if slots.replica_bytes <= 0:
            return None  # numpy's division by zero, not worth mirroring
        return _i64(slots.room), slots.per_pair, slots.replica_bytes, slots.limit, True
    if callable(slots):
        return None
    if isinstance(slots, np.integer):
        return None, 0, 1, int(slots), False
    return _i64([int(s) for s in slots]), 0, 1, 0, False


def max_moves(rule: SlotRule, num_ranks: int, num_experts: int) -> int:
    """Most moves one greedy run can make: each takes a slot, and at most one per (expert,
    rank); at least 1 (the size of a buffer)."""
    room, _, _, limit, linear = rule
    most = num_experts * num_ranks
    if room is None or linear:  # every slot at most ``limit``
        return max(1, min(most, num_ranks * limit) if limit >= 0 else most)
    if room.size and int(room.min()) >= 0:
        return max(1, min(most, int(room.sum())))
    return max(1, most)  # negative slots never run out: one move per (expert, rank) at most


def place_search(
    lib: ctypes.CDLL,
    expert_load: np.ndarray,
    num_ranks: int,
    rule: SlotRule,
    tolerance: float,
) -> tuple[int, list[tuple[int, int, int]], int]:
    """``place_replicas``'s threshold search in C (``num_ranks >= 2``): ``(best threshold,
    moves in the order made, greedy runs)``; the threshold is the search's best T, or the
    fixed-ownership peak when no run made a move."""
    loads = _i64(expert_load)
    room, per_pair, replica_bytes, limit, linear = rule
    cap = max_moves(rule, num_ranks, loads.size)
    out = np.empty(5 + 3 * cap, dtype=np.int64)  # info, then the moves
    at = address(out)
    args = PLACE_SEARCH.pack(
        num_ranks,
        loads.size,
        address(loads),
        0 if room is None else address(room),
        per_pair,
        replica_bytes,
        limit,
        linear,
        tolerance,
        cap,
        at + 40,
        at,
    )
    check(lib.lrmoe_place_search_packed(args))
    threshold, count, runs, _, top = out[:5].tolist()
    found = list(map(tuple, out[5 : 5 + 3 * count].reshape(-1, 3).tolist()))
    return (threshold if count else top), found, runs


# --------------------------------------------------------------------------------------------- #
# The exact assignment (balance.HolderGraph's twins)
# --------------------------------------------------------------------------------------------- #


def min_max(
    lib: ctypes.CDLL,
    num_ranks: int,
    rank: Sequence[int],
    bounds: Sequence[int],
    room: Optional[Sequence[int]],
    base: Sequence[int],
    initial: Sequence[int],
    rank_cap: Optional[Sequence[Optional[int]]] = None,
) -> Optional[tuple[list[int], list[int]]]:
    """``HolderGraph(num_ranks, rank, bounds, room).min_max(base, initial, rank_cap)`` in C:
    ``(amount per entry, load per rank)``, or None when the rank caps cannot be met."""
    ranks, bound, x, base_ = _i64(rank), _i64(bounds), _i64(initial), _i64(base)
    room_ = None if room is None else _i64(room)
    caps = has = None
    if rank_cap is not None:
        caps = _i64([0 if c is None else c for c in rank_cap])
        if any(c is None for c in rank_cap):
            has = np.array([c is not None for c in rank_cap], dtype=np.uint8)
    load = np.empty(num_ranks, dtype=np.int64)
    status = check(
        lib.lrmoe_min_max(
            num_ranks,
            bound.size - 1,
            address(ranks),
            address(bound),
            None if room_ is None else address(room_),
            address(base_),
            address(x),
            None if caps is None else address(caps),
            None if has is None else address(has),
            address(load),
        )
    )
    return None if status == NONE else (x.tolist(), load.tolist())


def caps_cut(
    lib: ctypes.CDLL,
    num_ranks: int,
    rank: Sequence[int],
    bounds: Sequence[int],
    room: Optional[Sequence[int]],
    base: Sequence[int],
    initial: Sequence[int],
    rank_cap: Sequence[int],
) -> Optional[list[int]]:
    """``HolderGraph(num_ranks, rank, bounds, room).caps_cut(base, initial, rank_cap)`` in C:
    None when the caps admit an assignment, else the ranks of a violated cut (ascending)."""
    ranks, bound, x, base_, caps = (
        _i64(rank),
        _i64(bounds),
        _i64(initial),
        _i64(base),
        _i64(rank_cap),
    )
    room_ = None if room is None else _i64(room)
    load = np.empty(num_ranks, dtype=np.int64)
    cut = np.empty(max(num_ranks, 1), dtype=np.int64)
    count = lib.lrmoe_caps_cut(
        num_ranks,
        bound.size - 1,
        address(ranks),
        address(bound),
        None if room_ is None else address(room_),
        address(base_),
        address(x),
        address(caps),
        address(load),
        address(cut),
    )
    if count < 0:
        raise NativeError("out of memory in the planner's native code")
    return cut[:count].tolist() if count else None
