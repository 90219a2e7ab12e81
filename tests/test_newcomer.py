"""What a newcomer meets first: ``--lrmoe-help``, a ``--help`` without log lines, a set-up script
that installs only when needed, a quiet demo environment, and a test run without environmental
warnings (pytest.ini)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_lrmoe.training.args import LRMOE_FLAGS, LRMOE_HELP_FLAG, LRMOE_KERNEL_FLAGS

ROOT = Path(__file__).resolve().parents[1]
# A fresh interpreter importing torch and megatron (--help) takes ~10 s on a busy 2-core machine.
TIMEOUT_S = 300
# A log record's start: logging's default format ("INFO:name:...") or torch's glog-like one
# ("W1130 19:01:53.768000 123 file.py:183] ...").
LOG_LINE = re.compile(r"^((DEBUG|INFO|WARNING|ERROR|CRITICAL)[: ]|[DIWEF]\d{4} \d\d:\d\d:\d\d)")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), **kwargs
    )


# -- pretrain_lrmoe.py --lrmoe-help / --help ----------------------------------------------------


def test_lrmoe_help_lists_exactly_the_lrmoe_flags() -> None:
    proc = _run(sys.executable, str(ROOT / "pretrain_lrmoe.py"), LRMOE_HELP_FLAG, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    options = {m.group(1) for line in lines if (m := re.match(r"^  (-[-\w]+)", line))}
    wanted = {
        "--lrmoe",
        LRMOE_HELP_FLAG,
        "--moe-layer-timing",
        "--memory-cap-gib",
        "--gpu-memory-gib",
        "--lrmoe-trace-dir",
        *LRMOE_FLAGS.values(),
        *LRMOE_KERNEL_FLAGS.values(),
    }
    # --lrmoe-record-stats shares its line with --no-lrmoe-record-stats (and each kernel
    # switch with its --no- form).
    assert options == wanted, sorted(options ^ wanted)
    assert "--no-lrmoe-record-stats" in proc.stdout
    for flag in LRMOE_KERNEL_FLAGS.values():
        assert "--no-" + flag[2:] in proc.stdout, flag
    # LRMoE's sections only: none of Megatron's groups (network size, training, ...).
    sections = [line for line in lines if re.match(r"^\S.*:$", line)]
    assert sections == ["LRMoE:", "LRMoE kernels:"], sections
    assert not [line for line in lines if LOG_LINE.match(line)]


def test_lrmoe_help_answers_before_importing_torch() -> None:
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = ["pretrain_lrmoe.py", "{LRMOE_HELP_FLAG}"]
        try:
            runpy.run_path({str(ROOT / "pretrain_lrmoe.py")!r}, run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print("torch imported:", "torch" in sys.modules, file=sys.stderr)
        """
    )
    proc = _run(sys.executable, "-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch imported: False" in proc.stderr
    assert "LRMoE:" in proc.stdout


def test_help_stdout_holds_no_log_line() -> None:
    proc = _run(sys.executable, str(ROOT / "pretrain_lrmoe.py"), "--help", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:500]
    log_lines = [line for line in proc.stdout.splitlines() if LOG_LINE.match(line)]
    assert not log_lines, log_lines
    assert LRMOE_HELP_FLAG in proc.stdout  # the full --help points at the short one


def test_lrmoe_logs_go_to_stderr() -> None:
    code = textwrap.dedent(
        """
        import logging
        import pretrain_lrmoe
        pretrain_lrmoe.log_to_stderr()
        pretrain_lrmoe.log_to_stderr()  # idempotent: one line, not two
        logging.getLogger("megatron_lrmoe.training.compat").info("marker line")
        """
    )
    proc = _run(sys.executable, "-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "marker line" not in proc.stdout
    assert proc.stderr.count("INFO:megatron_lrmoe.training.compat:marker line") == 1


# -- scripts/env.sh: install only when the venv is out of date ----------------------------------


# What env.sh's lrmoe_env_current asks a venv to find before it calls it current.
_ENV_MODULES = ("torch", "megatron.core", "pytest", "matplotlib")


def _fake_checkout_and_venv(tmp_path: Path, pythonpath: Path) -> tuple[Path, Path]:
    """A checkout with a setup.py and an (empty) package, and a venv whose python is this
    interpreter with ``pythonpath`` first on its path and no pip (so a wrong answer cannot
    install anything).

    The fake venv finds the modules env.sh checks where this interpreter finds them: its own
    site-packages, or this run's ``PYTHONPATH`` (e.g. the GPU host's megatron-core wheel
    unpacked into a folder), which env.sh drops when it asks the venv itself.
    """
    import importlib.util

    missing = [m for m in _ENV_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"this interpreter lacks {missing}, which env.sh requires of a current venv")
    path = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    root = tmp_path / "checkout"
    (root / "megatron_lrmoe").mkdir(parents=True)
    (root / "megatron_lrmoe" / "__init__.py").write_text("")
    (root / "pretrain_lrmoe.py").write_text("")
    (root / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" pip "*) echo "no pip in this fake venv" >&2; exit 3;; esac\n'
        f'PYTHONPATH="{path}" exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return root, venv


def _env_sh(function: str, *args: str) -> subprocess.CompletedProcess:
    script = f'source "{ROOT}/scripts/env.sh"; {function} "$@"'
    return subprocess.run(
        ["bash", "-c", script, "env.sh", *args], capture_output=True, text=True, timeout=120
    )


def test_env_stamp_decides_when_to_install(tmp_path: Path) -> None:
    root, venv = _fake_checkout_and_venv(tmp_path, pythonpath=tmp_path / "checkout")
    assert _env_sh("lrmoe_env_current", str(root), str(venv)).returncode == 1  # no stamp yet

    stamp = _env_sh("lrmoe_env_stamp", str(root), str(venv / "bin" / "python"))
    assert stamp.returncode == 0, stamp.stderr
    assert f"python {sys.version.split()[0]}" in stamp.stdout
    (venv / ".lrmoe-env-stamp").write_text(stamp.stdout)
    assert _env_sh("lrmoe_env_current", str(root), str(venv)).returncode == 0

    (root / "setup.py").write_text("from setuptools import setup\nsetup(name='x')\n")
    assert _env_sh("lrmoe_env_current", str(root), str(venv)).returncode == 1  # setup.py changed


def test_env_stamp_requires_the_package_from_this_checkout(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "megatron_lrmoe").mkdir(parents=True)
    (elsewhere / "megatron_lrmoe" / "__init__.py").write_text("")
    (elsewhere / "pretrain_lrmoe.py").write_text("")
    root, venv = _fake_checkout_and_venv(tmp_path, pythonpath=elsewhere)
    stamp = _env_sh("lrmoe_env_stamp", str(root), str(venv / "bin" / "python"))
    (venv / ".lrmoe-env-stamp").write_text(stamp.stdout)
    # Same setup.py and Python, but the venv imports another checkout's megatron_lrmoe.
    assert _env_sh("lrmoe_env_current", str(root), str(venv)).returncode == 1


def test_env_sh_skips_the_install_when_current(tmp_path: Path) -> None:
    _, venv = _fake_checkout_and_venv(tmp_path, pythonpath=ROOT)
    stamp = _env_sh("lrmoe_env_stamp", str(ROOT), str(venv / "bin" / "python"))
    (venv / ".lrmoe-env-stamp").write_text(stamp.stdout)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "env.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, LRMOE_VENV=str(venv)),
    )
    # The fake venv has no pip: an install attempt would fail with "no pip in this fake venv".
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(venv / "bin" / "python")
    assert proc.stderr == ""


def test_env_sh_names_a_full_disk(tmp_path: Path) -> None:
    """A CI run once failed with pip's OSError 28 at the end of 100 lines of output; env.sh then
    says plainly that the disk filled up, how much the venv needs and what is free."""
    full = tmp_path / "full.log"
    full.write_text(
        "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    )
    other = tmp_path / "other.log"
    other.write_text("ERROR: No matching distribution found for torch>=2.11\n")
    said = _env_sh("lrmoe_env_explain_failure", str(full), str(tmp_path))
    assert said.returncode == 0
    assert "disk filled up" in said.stderr and "5.6 GB" in said.stderr
    assert "Avail" in said.stderr  # df's table of what is free
    quiet = _env_sh("lrmoe_env_explain_failure", str(other), str(tmp_path))
    assert quiet.returncode == 0 and quiet.stderr == ""


# -- lrmoe-demo's quiet mode ---------------------------------------------------------------------


def test_demo_quiet_environment_reaches_child_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_lrmoe.demo import main as demo

    monkeypatch.setenv("PYTHONWARNINGS", "default")
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    code = (
        "import warnings; "
        "warnings.warn('Apex is not installed. Falling back to Torch Norm'); "
        "warnings.warn('a warning nobody listed')"
    )
    with demo._quiet_environment():
        assert "-torch.utils.cpp_extension" in os.environ["TORCH_LOGS"].split(",")
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    assert "a warning nobody listed" in child.stderr
    assert "Apex is not installed" not in child.stderr
    assert os.environ["PYTHONWARNINGS"] == "default"  # restored
    assert "TORCH_LOGS" not in os.environ


# -- pytest.ini ----------------------------------------------------------------------------------


def test_pytest_ini_hides_only_the_listed_warnings(tmp_path: Path) -> None:
    test_file = tmp_path / "test_warns.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import warnings

            def test_warns():
                warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
                warnings.warn("Could not determine rank from torch.distributed, RANK, or "
                              "SLURM_PROCID. Defaulting to rank 0.", UserWarning)
                warnings.warn("Apex is not installed. Something new", UserWarning)
            """
        )
    )
    proc = _run(
        sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "-q", str(test_file)
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 1 warning" in proc.stdout, proc.stdout[-3000:]
    assert "Something new" in proc.stdout
    assert "Torch Norm" not in proc.stdout and "Defaulting to rank 0" not in proc.stdout


# -- docs/demo.md is generated -------------------------------------------------------------------


def test_demo_page_matches_its_committed_run() -> None:
    """docs/demo.md is what scripts/demo_report.py renders from docs/runs/demo/ (regenerate both
    with the command the page names, never edit the page by hand)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("demo_report", ROOT / "scripts/demo_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    run_dir = ROOT / report.RUN_DIR
    results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    run = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    page = (ROOT / report.PAGE).read_text(encoding="utf-8")
    assert page == report.render(results, run)
    assert (run_dir / "loss_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.REGENERATE in page
