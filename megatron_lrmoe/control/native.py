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
takes its Python path. ``LRMoEConfig.kernels.native_planner=False`` (``--no-lrmoe-native-planner``)
makes ``plan_call`` take the Python path without asking for the library; a caller of the
planner's parts that holds no config passes ``lib=None`` for the same.

Shape legend as in assignment.py: P ranks, E experts, M replicated experts (items), K holder
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
from typing import NamedTuple, Optional, Sequence

import numpy as np

from megatron_lrmoe.control.slots import LinearSlots

__all__ = [
    "NativeError",
    "PlacedCall",
    "backward",
    "best_fit_greedy",
    "build",
    "caps_cut",
    "counts",
    "library",
    "min_max",
    "place_call",
    "place_search",
    "reset",
    "start_caps_cut",
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
    """The compiled library, building it on first use; None when it cannot be built or loaded
    (then one warning, and callers use their Python paths)."""
    if not _State.tried:
        _State.tried = True
        try:
            _State.lib = _load(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning(
                "megatron_lrmoe: the planner's native code is unavailable (%s); using the "
                "Python planner (same plans, slower). Pass --no-lrmoe-native-planner "
                "(LRMoEConfig.kernels.native_planner=False) to silence this.",
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


# --------------------------------------------------------------------------------------------- #
# The controller's per-call entry points (one packed argument block each, see PLACE_CALL)
# --------------------------------------------------------------------------------------------- #


def counts(
    lib: ctypes.CDLL, n: np.ndarray, keep_ratio: float, abs_tol: float, rel_tol: float
) -> Optional[np.ndarray]:
    """``lrmoe_counts``: ``[2, E]`` the pairs per expert W and the uncapped quotas Q0
    (``quota.quotas_np`` with its tolerances) of the ``[P, E]`` counts ``n`` in one pass, or None
    when a count is negative."""
    out = np.empty((2, n.shape[1]), dtype=np.int64)
    at = address(out)
    args = COUNTS.pack(*n.shape, address(n), keep_ratio, abs_tol, rel_tol, at, at + 8 * n.shape[1])
    if lib.lrmoe_counts(args):
        return None
    return out


class PlacedCall(NamedTuple):
    """What ``lrmoe_place_call`` wrote, as views of its one block (see :func:`place_call`).

    ``holders``: the holder columns ``(expert, rank, forward, flat)`` ``[K]`` each, ``bounds``
    ``[M + 1]`` and ``experts`` ``[M]``, or None when no expert is replicated (M = 0); then
    ``holder_addresses`` is None too, else ``(M, expert, rank, forward, flat, bounds)`` as the
    C calls take them. ``backward_*``: the uncapped quotas' assignment without caps (its load
    ``[E, P]``, rank load ``[P]`` and ``(its peak, the fixed-ownership peak)``).
    """

    threshold: int
    peaks: tuple[int, ...]  # (forward peak, fixed-ownership peak)
    holders: Optional[tuple[np.ndarray, ...]]
    holder_addresses: Optional[tuple[int, ...]]
    forward_load: np.ndarray  # [E, P]
    backward_load: np.ndarray  # [E, P]
    backward_rank_load: np.ndarray  # [P]
    backward_peaks: tuple[int, ...]
    holds: np.ndarray  # [E, P] bool
    rigid: np.ndarray  # [E] bool
    rigid_address: int
    forward_rank_load: np.ndarray  # [P]
    replicas_per_rank: np.ndarray  # [P]
    fixed_rank_load: np.ndarray  # [P]


def place_call(
    lib: ctypes.CDLL,
    num_ranks: int,
    num_experts: int,
    w_address: int,
    rule: Optional[SlotRule],
    tolerance: float,
    q0: np.ndarray,
    save: bool,
) -> PlacedCall:
    """``lrmoe_place_call``: the placement's threshold search (``rule``: its slots' C form, or
    None for no search), the holders of its moves, the forward matrices and the uncapped
    quotas' (``q0``) backward assignment, all written into one zeroed block."""
    search = rule is not None
    moves = max_moves(rule, num_ranks, num_experts) if search else 1
    size, p, k = num_experts * num_ranks, num_ranks, 2 * moves
    # One zeroed block (C writes a few entries per row of the [E, P] matrices), in int64
    # words: info (threshold, K, M, forward peak, fixed peak), the forward /
    # replicas / fixed [P] loads, holder columns expert / rank / forward / flat [2 * moves]
    # each, bounds [moves + 1], experts [moves], the forward load [E * P], the uncapped
    # quotas' backward load [E * P], rank load [P] and its two peaks; then bytes: holds
    # [E * P], rigid [E].
    cols = 5 + 3 * p
    bounds_at = cols + 4 * k
    experts_at = bounds_at + moves + 1
    load_at = experts_at + moves
    back_at = load_at + size
    words = back_at + size + p + 2
    block = np.zeros(8 * words + size + num_experts, dtype=np.uint8)
    ints, flags = block[: 8 * words].view(np.int64), block[8 * words :].view(np.bool_)
    at = address(block)
    room, per_pair, replica_bytes, limit, linear = rule or (None, 0, 1, 0, False)
    holders_at = [at + 8 * (cols + c * k) for c in range(4)] + [at + 8 * bounds_at]
    experts_address = at + 8 * experts_at
    args = PLACE_CALL.pack(
        num_ranks,
        num_experts,
        w_address,
        search,
        0 if room is None else address(room),
        per_pair,
        replica_bytes,
        limit,
        linear,
        tolerance,
        moves,
        at,  # info
        *holders_at,
        experts_address,
        at + 8 * load_at,  # forward load
        at + 8 * words,  # holds
        at + 8 * words + size,  # rigid
        at + 40,  # forward rank load
        at + 40 + 8 * p,  # replicas per rank
        at + 40 + 16 * p,  # fixed rank load
        address(q0),
        save,
        at + 8 * back_at,  # backward load
        at + 8 * (back_at + size),  # backward rank load, its peaks
    )
    check(lib.lrmoe_place_call(args))
    threshold, count, items, *peaks = ints[:5].tolist()
    holders = holder_addresses = None
    if items:
        expert, rank, forward, flat = ints[cols : cols + 4 * k].reshape(4, k)[:, :count]
        bounds = ints[bounds_at : bounds_at + items + 1]
        experts = ints[experts_at : experts_at + items]
        holders = (expert, rank, forward, flat, bounds, experts)
        holder_addresses = (items, *holders_at)  # M, expert, rank, forward, flat, bounds
    return PlacedCall(
        threshold,
        tuple(peaks),
        holders,
        holder_addresses,
        ints[load_at:back_at].reshape(num_experts, num_ranks),
        ints[back_at : back_at + size].reshape(num_experts, num_ranks),
        ints[back_at + size : back_at + size + p],
        tuple(ints[back_at + size + p :].tolist()),
        flags[:size].reshape(num_experts, num_ranks),
        flags[size:],
        at + 8 * words + size,
        ints[5 : 5 + p],
        ints[5 + p : 5 + 2 * p],
        ints[5 + 2 * p : 5 + 3 * p],
    )


def backward(
    lib: ctypes.CDLL,
    num_ranks: int,
    num_experts: int,
    quota: np.ndarray,
    w_address: int,
    rigid_address: int,
    holder_addresses: tuple[int, ...],
    save: bool,
    caps: Optional[np.ndarray],
) -> Optional[tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
    """``lrmoe_backward``: the exact min-max backward assignment of ``quota`` (``[E]``) over the
    holders (``holder_addresses``: ``(M, expert, rank, forward, flat, bounds)``) under the rank
    ``caps`` (``[P]``, or None): ``(load [E, P], rank load [P], (its peak, the fixed-ownership
    peak))``, or None when the caps admit no assignment."""
    size = num_experts * num_ranks
    # backward load [E * P], rank load [P], its peak, the fixed-ownership peak
    out = np.zeros(size + num_ranks + 2, dtype=np.int64)
    at = address(out)
    args = BACKWARD.pack(
        num_ranks,
        num_experts,
        address(quota),
        w_address,
        rigid_address,
        *holder_addresses,
        save,
        0 if caps is None else address(caps),
        at,
        at + 8 * size,
    )
    if check(lib.lrmoe_backward(args)) == NONE:
        return None
    load = out[:size].reshape(num_experts, num_ranks)
    peaks = tuple(out[size + num_ranks :].tolist())
    return load, out[size : size + num_ranks], peaks


def start_caps_cut(
    lib: ctypes.CDLL,
    num_ranks: int,
    num_experts: int,
    quota: np.ndarray,
    w_address: int,
    rigid_address: int,
    holder_addresses: tuple[int, ...],
    save: bool,
    caps: np.ndarray,
) -> Optional[list[int]]:
    """``lrmoe_start_caps_cut``: the starting split of ``quota`` and the holder graph's
    feasibility under the rank ``caps`` (``[P]``): None when they admit an assignment, else the
    ranks of a violated cut (ascending)."""
    cut = np.empty(max(num_ranks, 1), dtype=np.int64)
    items, expert, rank, forward, _, bounds = holder_addresses
    args = START_CAPS_CUT.pack(
        num_ranks,
        num_experts,
        address(quota),
        w_address,
        rigid_address,
        items,
        expert,
        rank,
        forward,
        bounds,
        save,
        address(caps),
        address(cut),
    )
    count = check(lib.lrmoe_start_caps_cut(args))  # -1: out of memory
    return cut[:count].tolist() if count else None
