"""The GLM-4.5-Air proxy's launch scripts, run tiny on CPU through ``pretrain_lrmoe.py``.

The very scripts of the GPU run -- ``benchmarks/glm_compare.sh`` and
``examples/glm45_air/proxy_1xh200.sh`` (which runs ``examples/glm45_air/pretrain.sh``) -- run
Megatron's ``pretrain()`` here with the proxy's feature set: a shared expert, a sigmoid router
with expert bias (aux-loss-free balancing) and sequence aux loss, one MTP layer, partial RoPE,
QKV bias, full activation recomputation, the distributed optimizer, bf16. Only the sizes change:
the size flags below are appended to the script's (a later flag wins), and
``ENTRY=megatron_lrmoe/testing/cpu_pretrain.py`` runs the entry point on CPU over gloo.

* ``glm_compare.sh``, stock and LRMoE keep 0.5 ``sample`` side by side: both complete with
  finite, falling losses, the same first loss (the forward is exact), LRMoE keeps about half
  the pairs, the summary is written, and each run trained what it should (MoE layer class,
  shared experts, MTP layer, recomputation, moving expert biases).
* ``proxy_1xh200.sh`` stock against LRMoE keep 1.0, in fp32: the same losses, gradient norms
  and validation loss at every iteration (keep 1.0 equals stock; bf16 GEMMs round differently
  between the two expert implementations, so the check runs in fp32).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cpu_launch import ROOT, assert_same_curves, launch_env
from cpu_launch import curves as _curves
from cpu_launch import model_report as _report
TIMEOUT_S = 600  # a hang guard for the whole subprocess, start-up on a busy machine included
ITERS = 6
KEEP = "0.5"

# The proxy's feature set at tiny sizes: 1 dense + 1 MoE layer + MTP, 8 experts top-2.
SIZE_FLAGS = [
    "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "8",
    "--num-query-groups", "2", "--kv-channels", "16",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32",
    "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512",
]  # fmt: skip

def _env(**extra: str) -> dict[str, str]:
    return launch_env(TRAIN_ITERS=str(ITERS), EVAL_INTERVAL="3", GBS="2", **extra)


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level indexed dataset of this repository's Python sources."""
    prefix = tmp_path_factory.mktemp("glm_data") / "repo_bytes"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_indexed_dataset.py"),
         "--output-prefix", str(prefix), "--input", str(ROOT / "megatron_lrmoe"),
         "--max-bytes", "400000"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return str(prefix)


@pytest.fixture(scope="module")
def compare(data_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``benchmarks/glm_compare.sh`` in its two-GPU (side by side) mode, tiny, on CPU."""
    out = tmp_path_factory.mktemp("glm_compare")
    env = _env(
        GPUS="2",
        KEEP_RATIO=KEEP,
        SKIP_ITERS="1",
                DATA_PREFIX=data_prefix,
        EXTRA_ARGS=" ".join(SIZE_FLAGS),
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "glm_compare.sh"), str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    logs = {name: (out / f"train_{name}.log").read_text() for name in ("stock", f"keep{KEEP}")}
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs[f"keep{KEEP}"][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    return {"stdout": proc.stdout, "logs": logs, "summary": {r["run"]: r for r in summary}}


def test_compare_runs_complete(compare: dict[str, Any]) -> None:
    assert f"both runs reached {ITERS} iterations: yes" in compare["stdout"]
    for name, row in compare["summary"].items():
        assert row["iterations"] == ITERS and row["exit"] == 0, name
        assert not row["out_of_memory"], name
        curves = _curves(compare["logs"][name])
        assert len(curves["lm"]) == ITERS, name
        values = curves["lm"] + curves["mtp"] + curves["val"]
        assert all(math.isfinite(v) for v in values), f"{name}: {values}"
        # Byte-level text from a uniform start: the loss falls within a few steps.
        assert curves["lm"][-1] < curves["lm"][0] and curves["val"][-1] < curves["lm"][0], name
        assert math.isfinite(row["s_per_iter_median"]), name
        assert math.isfinite(row["moe_ms_per_iter_median"]), name  # --moe-layer-timing


def test_compare_first_loss_is_stock(compare: dict[str, Any]) -> None:
    """Same weights, data and forward: iteration 1's loss agrees to bf16 rounding (the exact and
    the trimmed path apply the routing weight at different points)."""
    stock = _curves(compare["logs"]["stock"])
    lrmoe = _curves(compare["logs"][f"keep{KEEP}"])
    for key in ("lm", "mtp"):
        assert lrmoe[key][0] == pytest.approx(stock[key][0], rel=1e-4), key
    # After that, keep 0.5 follows its own (close) trajectory.
    assert lrmoe["lm"][-1] == pytest.approx(stock["lm"][-1], rel=0.02)


def test_compare_trains_the_proxy_feature_set(compare: dict[str, Any]) -> None:
    expected_layer = {"stock": "MoELayer:2", f"keep{KEEP}": "LRMoELayer:2"}
    for name, log in compare["logs"].items():
        report = _report(log)
        # One MoE decoder layer and the MTP layer's; shared experts in both.
        assert report["moe_layers"] == expected_layer[name], report
        assert report["shared_experts"] == "2" and report["mtp_layers"] == "1", report
        assert report["recompute"] == "full", report
        # Aux-loss-free balancing moved both routers' expert biases.
        assert report["expert_bias_routers"] == "2", report
        assert float(report["expert_bias_max_change"]) > 0, report
        for flag, value in (
            ("moe_router_score_function", "sigmoid"),
            ("moe_router_load_balancing_type", "seq_aux_loss"),
            ("rotary_percent", "0.5"),
            ("add_qkv_bias", "True"),
            ("bf16", "True"),
            ("use_distributed_optimizer", "True"),
            ("lrmoe", str(name != "stock")),
        ):
            assert re.search(rf"^  {flag} \.+ {re.escape(value)}$", log, re.M), (name, flag)


def test_compare_lrmoe_statistics(compare: dict[str, Any]) -> None:
    row = compare["summary"][f"keep{KEEP}"]
    assert 0.45 < row["kept_mean"] < 0.6
    assert 0.0 < row["dropped_score_mean"] < 1.0
    assert compare["summary"]["stock"]["kept_mean"] is None
    assert "lrmoe kept" not in compare["logs"]["stock"]


def test_keep1_equals_stock_fp32(data_prefix: str, tmp_path: Path) -> None:
    """The proxy script with LRMoE at keep 1.0 trains on stock's curve (fp32, tight)."""
    runs = {"stock": {"LRMOE": "0"}, "keep1": {"LRMOE": "1", "KEEP_RATIO": "1.0"}}
    procs = {}
    for name, extra in runs.items():
        env = _env(
            LRMOE_CPU_FP32="1",
                        DATA_PREFIX=data_prefix,
            DATA_CACHE=str(tmp_path / f"cache_{name}"),
            **extra,
        )
        procs[name] = subprocess.Popen(
            ["bash", str(ROOT / "examples" / "glm45_air" / "proxy_1xh200.sh"), *SIZE_FLAGS],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    logs = {}
    for name, proc in procs.items():
        logs[name], _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, logs[name][-3000:]
        assert re.search(r"^  bf16 \.+ False$", logs[name], re.M), name
    stock, keep1 = _curves(logs["stock"]), _curves(logs["keep1"])
    assert _report(logs["keep1"])["moe_layers"] == "LRMoELayer:2"
    assert_same_curves(keep1, stock, ("lm", "mtp", "grad_norm", "val"))
    assert stock["lm"][-1] < stock["lm"][0]
