"""Running the example launch scripts tiny on CPU, and reading their logs (test helpers).

The scripts run Megatron's ``pretrain()`` through ``pretrain_lrmoe.py``;
``ENTRY=megatron_lrmoe/testing/cpu_pretrain.py`` makes the same entry point run on CPU over gloo.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Megatron's iteration line (the MTP loss only where the model has MTP layers).
_ITER = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \| consumed samples.*?lm loss: (\S+) \|"
    r"(?:.*?mtp_1 loss: (\S+) \|)?.*?grad norm: (\S+) \|"
)
_VAL = re.compile(r"validation loss at iteration (\d+)(?: on (\w+) set)? \| lm loss value: (\S+)")
_REPORT = re.compile(r"cpu_pretrain model: (.*)")


def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launch script run on CPU: this checkout, the CPU entry point, a few
    iterations with evaluation; ``extra`` overrides (e.g. ``GBS``, ``KEEP_RATIO``)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHON": sys.executable,
        "ENTRY": "megatron_lrmoe/testing/cpu_pretrain.py",
        "WARMUP_ITERS": "1",
        "EVAL_ITERS": "1",
        "MASTER_PORT": str(free_port()),
    }
    env.pop("DRY_RUN", None)
    env.update(extra)
    return env


def model_report(log: str) -> dict[str, str]:
    """The key=value pairs of cpu_pretrain's model line."""
    match = _REPORT.search(log)
    assert match, "no cpu_pretrain model line in the log"
    return dict(item.split("=", 1) for item in match.group(1).split())


def curves(log: str) -> dict[str, list[float]]:
    """Per-iteration ``lm`` loss, ``mtp`` loss (where logged), ``grad_norm``, and the ``val``
    losses, in log order."""
    rows = _ITER.findall(log)
    return {
        "lm": [float(r[1]) for r in rows],
        "mtp": [float(r[2]) for r in rows if r[2]],
        "grad_norm": [float(r[3]) for r in rows],
        "val": [float(m[2]) for m in _VAL.findall(log)],
    }


def assert_same_curves(got: dict, want: dict, keys: tuple[str, ...]) -> None:
    """``got``'s curves equal ``want``'s (both from :func:`curves`) as far as the log prints them:
    losses 7 digits, gradient norms 3 decimals (one unit of slack)."""
    for key in keys:
        assert len(got[key]) == len(want[key]) > 0, key
        tolerance = {"abs": 1.01e-3} if key == "grad_norm" else {"rel": 1e-5}
        assert got[key] == pytest.approx(want[key], **tolerance), key
