"""Run a test module's Triton-kernel tests under Triton's interpreter, in a subprocess.

Triton reads ``TRITON_INTERPRET=1`` when it is first imported (it wraps its own helpers then), and
a pytest process has imported triton already (megatron.core does). So the kernel tests of a
module are named ``test_interp_*``, skipped in the normal run, and re-run here in a child pytest
with the variable set, so that no other test module sees it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_tests(test_file: str | Path, min_passed: int, timeout: float = 600.0) -> None:
    """Run ``test_file``'s ``test_interp_*`` tests with ``TRITON_INTERPRET=1``; all must pass.

    Args:
        test_file: The test module (its ``__file__``).
        min_passed: At least this many must have run and passed: a skip would mean the
            interpreter was not on.
        timeout: Seconds for the child run.

    Raises:
        AssertionError: The child run failed, skipped a test or ran fewer than ``min_passed``.
    """
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    proc = subprocess.run(
        [*cmd, "-k", "test_interp_", str(Path(test_file).resolve())],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, f"interpreter run failed (rc {proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed, summary
    assert not re.search(r"skipped|failed|error", summary), summary
