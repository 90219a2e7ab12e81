"""Multi-process test harness: run a function on ``world_size`` local ranks over loopback.

Typical use in a test::

    def _check_layer(rank: int, world_size: int, ep: int) -> float:   # module level!
        pg_collection = init_megatron_parallel(ep=ep)
        ...
        return loss.item()

    def test_layer() -> None:
        losses = run_distributed(_check_layer, 2, 2)

``fn`` is sent to the children with pickle, so it must be a module-level function of an
importable module (no lambdas, closures or nested functions), and its arguments and return value
must be picklable.

CPU ranks start from a ``forkserver`` that has imported torch and megatron-core once per parent
process (:data:`FORKSERVER_PRELOAD`): every run still gets fresh processes, but not a fresh
import of those packages, which costs 5-15 s per rank on a 2-core CI machine. The children get
the parent's environment as it is when the run starts (as with ``spawn``), applied before
anything else of ours runs; only what torch and megatron-core read from the environment *at
import* comes from the forkserver's start. A run whose :data:`IMPORT_TIME_ENV` differs from the
forkserver's (``TRITON_INTERPRET=1``: Triton reads it when it is imported) is spawned, as are
CUDA ranks (``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STARTUP_TIMEOUT_S",
    "FORKSERVER_PRELOAD",
    "IMPORT_TIME_ENV",
    "DistributedTestError",
    "init_megatron_parallel",
    "run_distributed",
]

# How long the parent keeps draining the result queue after noticing that a child exited, since
# a child can put its result and exit before the queue's feeder thread has delivered it.
_EXIT_GRACE_S = 2.0
# Poll period of the parent loop; bounds how late a crash or timeout is noticed.
_POLL_S = 0.1
# After the first failure, how long to wait for the other ranks' reports before raising.
_FAILURE_GRACE_S = 0.5
# Default budget for a rank's start-up (spawn, imports, CPU shim, process-group rendezvous). It is
# separate from ``timeout`` because start-up time is the machine's load, not the test's behaviour:
# on a busy 2-core CI machine spawning a rank and importing torch + megatron can take a minute.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
# What the CPU ranks' forkserver imports once per parent process: the heavy third-party packages
# only. Not megatron_lrmoe, so that each rank imports our code after applying the run's
# environment, and not the CPU shim (each rank installs it, as before, so that its patches never
# reach a process that did not ask for them).
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.optimizer",
)
# Variables that the preloaded packages read when they are imported: a run that sets one of them
# differently from the forkserver's start is spawned, so that its ranks import afresh.
IMPORT_TIME_ENV = ("TRITON_INTERPRET",)
# The IMPORT_TIME_ENV values the forkserver started with (None until the first CPU run).
_forkserver_env: tuple[str | None, ...] | None = None
# Message kinds a child puts on the result queue.
_READY, _OK, _ERROR = "ready", "ok", "error"
# Substrings of gloo errors that only mean "a peer went away": symptoms, not causes.
_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed, crashed or did not finish in time.

    Attributes:
        failed_ranks: ranks that raised, crashed or timed out.
        tracebacks: rank -> formatted traceback (or a short reason) for each failed rank.
        ready_after_s: rank -> seconds from the start of the run until that rank had finished
            its start-up and began ``fn`` (ranks that never got there are absent).
    """

    def __init__(
        self,
        message: str,
        failed_ranks: list[int],
        tracebacks: dict[int, str],
        ready_after_s: dict[int, float] | None = None,
    ) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.tracebacks = tracebacks
        self.ready_after_s = dict(ready_after_s or {})


def _free_loopback_port() -> int:
    """Ask the kernel for a free TCP port on 127.0.0.1 (never a public interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _loopback_ifname() -> str | None:
    """Name of the loopback interface, so gloo does not pick an interface from the hostname."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platform without if_nameindex
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _cleanup_child() -> None:
    """Tear down megatron parallel state and the process group; never raises."""
    try:
        # Only touch megatron if the test imported it: importing it just to clean up costs seconds.
        if "megatron.core.parallel_state" in sys.modules:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    except Exception:
        logger.exception("destroy_model_parallel failed")
    try:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:
        logger.exception("destroy_process_group failed")


def _child_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    payload: bytes,
    results: Any,
    device: str = "cpu",
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of one rank (a process forked by the forkserver, or spawned for CUDA)."""
    if env is not None:  # a forkserver's children inherit the server's environment, not ours
        os.environ.clear()
        os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    ifname = _loopback_ifname()
    if ifname is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    try:
        # CI has two cores shared by all ranks; intra-op threads would only oversubscribe them.
        torch.set_num_threads(1)
        if device == "cuda":
            # One GPU per rank, as torchrun + megatron's initialize would do.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:  # the parent started this process with every GPU hidden (_gpus_hidden)
            from megatron_lrmoe.testing.cpu_shim import install_cpu_shim

            install_cpu_shim()
        fn, args, kwargs = pickle.loads(payload)
        torch.distributed.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            # The rendezvous waits for the slowest rank's start-up; the parent enforces the
            # per-rank deadlines of ``fn`` itself and terminates whatever outlives them.
            timeout=datetime.timedelta(seconds=max(pg_timeout, 1.0)),
        )
        # From here on the rank runs the test's own code: the parent starts its clock now.
        results.put((rank, _READY, None))
        result = fn(rank, world_size, *args, **kwargs)
        # Pickle here rather than in the queue's feeder thread, where a failure would only be
        # printed and the parent would wait for a result that never comes.
        message = (rank, _OK, pickle.dumps(result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        # Report first, clean up afterwards: peers may be blocked in a collective, and the parent
        # should not wait for our teardown to learn about the failure.
        results.put((rank, _ERROR, traceback.format_exc()))
        _cleanup_child()
        return
    _cleanup_child()
    results.put(message)


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill, every child that is still alive."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)


def _drain(results: Any, wait_s: float) -> list[tuple[int, str, Any]]:
    """Read every message available within ``wait_s`` seconds."""
    messages: list[tuple[int, str, Any]] = []
    deadline = time.monotonic() + wait_s
    while True:
        try:
            messages.append(results.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue_module.Empty:
            return messages


@contextlib.contextmanager
def _gpus_hidden() -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` empty while the block runs: processes spawned in it see no GPU
    (a spawned child reads its environment at start-up, before CUDA is initialised)."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    device: str = "cpu",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned local processes.

    Each child sets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` (a free loopback port),
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; sets ``torch.set_num_threads(1)``; with
    ``device="cpu"`` (the default) starts with every GPU hidden and installs the CPU shim, so
    that CPU tests run the same on a GPU machine as on a CPU-only one (``device="cuda"``: one
    GPU per rank, ``rank % device_count``, no shim); only then unpickles ``fn`` (so its module
    is imported with the shim in place); calls ``torch.distributed.init_process_group(backend)``;
    runs ``fn``; then destroys megatron's parallel state and the process group.

    Deadlines are per rank and split in two, so that a slow machine cannot make a rank that
    finished its work look hung: each rank has ``startup_timeout`` seconds from the start of the
    run to finish its start-up (everything before ``fn``), and then ``timeout`` seconds of its
    own to run ``fn``, counted from the moment it reported ready.

    A script (not a test module) that calls this must guard the call with
    ``if __name__ == "__main__":``, because ``spawn`` re-imports the main module in every child.

    Args:
        fn: a **module-level** function (it is pickled by reference for the ``spawn`` start
            method), called as ``fn(rank, world_size, *args, **kwargs)``. Its return value must be
            picklable.
        world_size: number of ranks.
        *args: extra positional arguments for ``fn`` (picklable).
        timeout: seconds each rank may spend in ``fn`` after its start-up.
        backend: ``torch.distributed`` backend.
        startup_timeout: seconds, from the start of the run, within which every rank must have
            started (spawned, imported, joined the process group).
        device: ``"cpu"`` (every GPU hidden from the ranks, CPU shim) or ``"cuda"`` (one GPU per
            rank; needs CUDA).
        **kwargs: extra keyword arguments for ``fn`` (picklable).

    Returns:
        The per-rank return values, in rank order.

    Raises:
        ValueError: ``world_size < 1``, a non-positive timeout, or a ``device`` other than
            ``"cpu"`` and ``"cuda"`` (``"cuda"`` without CUDA).
        TypeError: ``fn`` or its arguments cannot be pickled.
        DistributedTestError: a rank raised (the message holds its traceback), a rank exited
            without reporting, or a rank missed its deadline (the message names the ranks that
            did not finish, and ``ready_after_s`` when each rank started ``fn``). The other ranks
            are terminated in every case. The likely root cause is named first;
            ``failed_ranks`` and ``tracebacks`` hold the details.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(
            f"run_distributed: device must be 'cpu' or 'cuda' (with CUDA available), got "
            f"{device!r}"
        )
    if timeout <= 0 or startup_timeout <= 0:
        raise ValueError(
            f"timeout ({timeout}) and startup_timeout ({startup_timeout}) must be positive"
        )
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # pickle raises several unrelated exception types
        raise TypeError(
            f"run_distributed needs a module-level function and picklable arguments; could not "
            f"pickle {fn!r}: {exc}"
        ) from exc

    # CPU ranks apply the parent's environment, every GPU hidden, before anything else.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None
    ctx = (_cpu_context(env) if env is not None else None) or mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_loopback_port()
    processes = [
        ctx.Process(
            target=_child_main,
            args=(
                rank, world_size, port, backend, startup_timeout + timeout, payload, results,
                device, env,
            ),
            name=f"run_distributed-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    start = time.monotonic()
    run = _RunState(start=start, timeout=timeout, startup_timeout=startup_timeout)
    name = getattr(fn, "__qualname__", fn)
    try:
        with _gpus_hidden() if device == "cpu" else contextlib.nullcontext():
            for proc in processes:
                proc.start()
        while len(run.values) < world_size:
            overdue = run.overdue(world_size, time.monotonic())
            if overdue:
                missing = [r for r in range(world_size) if r not in run.values]
                raise DistributedTestError(
                    f"run_distributed({name!r}) timed out: {run.describe(overdue)}; ranks that "
                    f"did not finish: {missing}",
                    failed_ranks=missing,
                    tracebacks={r: "timed out" for r in missing},
                    ready_after_s=run.ready_after_s(),
                )
            messages = _drain(results, _POLL_S)
            failures = run.absorb(messages)
            if not failures and not messages:
                failures = run.absorb(_check_dead_children(processes, run.values, results))
            if failures:
                failures = _gather_failures(failures, processes, run, results)
                raise _failure_error(fn, failures, run.ready_after_s())
    finally:
        _stop(processes)
        results.cancel_join_thread()
        results.close()
    logger.debug("run_distributed(%s) finished in %.1fs", fn, time.monotonic() - start)
    return [run.values[rank] for rank in range(world_size)]


def _cpu_context(env: dict[str, str]) -> Any:
    """The ``forkserver`` context for CPU ranks that will run with ``env``, or ``None`` when
    they must be spawned (``env`` differs from the forkserver's in :data:`IMPORT_TIME_ENV`).

    The server preloads :data:`FORKSERVER_PRELOAD`; it starts on the first ``Process.start()``
    (inside :func:`_gpus_hidden`, so it and every rank forked from it see no GPU) and lives as
    long as the parent process.
    """
    global _forkserver_env
    wanted = tuple(env.get(name) for name in IMPORT_TIME_ENV)
    if _forkserver_env is None:
        _forkserver_env = wanted
    if wanted != _forkserver_env:
        return None
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


class _RunState:
    """What the parent knows about its ranks: when each became ready, and their results."""

    def __init__(self, start: float, timeout: float, startup_timeout: float) -> None:
        self.start = start
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.ready_at: dict[int, float] = {}
        self.values: dict[int, Any] = {}

    def deadline(self, rank: int) -> float:
        """When ``rank`` is overdue: start-up budget until ready, then its own ``fn`` budget."""
        if rank in self.ready_at:
            return self.ready_at[rank] + self.timeout
        return self.start + self.startup_timeout

    def overdue(self, world_size: int, now: float) -> list[int]:
        """Unfinished ranks past their deadline."""
        return [r for r in range(world_size) if r not in self.values and now > self.deadline(r)]

    def describe(self, overdue: list[int]) -> str:
        parts = []
        for r in overdue:
            if r in self.ready_at:
                parts.append(f"rank {r} ran fn for more than {self.timeout:.1f}s")
            else:
                parts.append(f"rank {r} did not start within {self.startup_timeout:.1f}s")
        return ", ".join(parts)

    def ready_after_s(self) -> dict[int, float]:
        return {r: t - self.start for r, t in sorted(self.ready_at.items())}

    def absorb(self, messages: list[tuple[int, str, Any]]) -> dict[int, str]:
        """Record ready times and results; return rank -> traceback for failures."""
        failures: dict[int, str] = {}
        now = time.monotonic()
        for rank, kind, data in messages:
            if kind == _READY:
                self.ready_at.setdefault(rank, now)
            elif kind == _OK:
                self.values[rank] = pickle.loads(data)
            else:
                failures[rank] = data
        return failures


def _crash_message(rank: int, exitcode: int | None) -> str:
    return (
        f"rank {rank} exited with code {exitcode} without reporting a result (crashed or "
        "killed; see its stderr). If it died at start-up, check that fn's module is importable "
        "and that a script calling run_distributed guards it with `if __name__ == '__main__':` "
        "(spawn re-imports __main__)."
    )


def _dead_unreported(processes: list[Any], reported: set[int]) -> list[int]:
    return [
        rank
        for rank, proc in enumerate(processes)
        if rank not in reported and not proc.is_alive() and proc.exitcode is not None
    ]


def _check_dead_children(
    processes: list[Any], values: dict[int, Any], results: Any
) -> list[tuple[int, str, Any]]:
    """Turn a child that exited without reporting into an error message for that rank."""
    dead = _dead_unreported(processes, set(values))
    if not dead:
        return []
    # Its result may still be in flight in the queue's pipe.
    messages = _drain(results, _EXIT_GRACE_S)
    reported = {rank for rank, kind, _ in messages if kind != _READY} | set(values)
    for rank in dead:
        if rank not in reported:
            messages.append((rank, _ERROR, _crash_message(rank, processes[rank].exitcode)))
    return messages


def _gather_failures(
    failures: dict[int, str], processes: list[Any], run: _RunState, results: Any
) -> dict[int, str]:
    """Complete the picture after a first failure, within a short grace period.

    The first report is often a symptom: when a rank crashes, its peers' collectives fail at
    once and may report before the parent notices the dead process. Collect what else arrives
    quickly and name the ranks that died without reporting, so the root cause is in the error.
    """
    for rank, data in run.absorb(_drain(results, _FAILURE_GRACE_S)).items():
        failures.setdefault(rank, data)
    for rank in _dead_unreported(processes, set(run.values) | set(failures)):
        failures[rank] = _crash_message(rank, processes[rank].exitcode)
    return failures


def _failure_error(
    fn: Callable[..., Any], failures: dict[int, str], ready_after_s: dict[int, float]
) -> DistributedTestError:
    """Build the error; the likely root cause comes first.

    Order: ranks that died without a traceback, then ordinary failures, then failures that are
    only gloo noticing a dead peer; within each class, arrival order (``failures`` keeps it).
    """
    ranks = sorted(failures)

    def cause_class(rank: int) -> int:
        text = failures[rank]
        if text.startswith(f"rank {rank} exited with code"):
            return 0
        if any(marker in text for marker in _PEER_LOST_MARKERS):
            return 2
        return 1

    # sorted() is stable, so arrival order survives inside each class.
    order = sorted(failures, key=cause_class)
    body = "\n".join(f"----- rank {r} -----\n{failures[r]}" for r in order)
    return DistributedTestError(
        f"run_distributed({getattr(fn, '__qualname__', fn)!r}): rank {order[0]} failed "
        f"(failed ranks: {ranks}); other ranks were terminated.\n{body}",
        failed_ranks=ranks,
        tracebacks=failures,
        ready_after_s=ready_after_s,
    )


def init_megatron_parallel(
    ep: int, tp: int = 1, seed: int = 1234, cp: int = 1
) -> ProcessGroupCollection:
    """Initialise megatron model parallelism inside a :func:`run_distributed` child.

    Calls ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)``
    (LRMoE's experts are not tensor-parallel; Megatron would default the expert TP size to
    ``tp``) and ``model_parallel_cuda_manual_seed(seed)`` (which works on CPU through the shim),
    then returns the process groups a ``MoELayer`` built without an explicit ``pg_collection``
    would use (``moe_utils.get_default_pg_collection()``).

    Args:
        ep: expert-model-parallel size.
        tp: tensor-model-parallel size.
        cp: context-parallel size.
        seed: base seed of megatron's RNG tracker (also seeds the default generator).

    Returns:
        The MoE ``ProcessGroupCollection`` (ep, tp, cp, expt_tp, expt_dp, tp_ep, tp_cp, tp_dp_cp).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "init_megatron_parallel must run inside run_distributed (no process group)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    # On a GPU this seeds only the CUDA generator; seed the CPU one too so that CPU-side draws in
    # tests are reproducible on both.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return get_default_pg_collection()
