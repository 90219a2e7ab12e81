"""Pipeline parallelism: the launch scripts with PP 2, tiny, on CPU over gloo (2 ranks, 2 stages).

The scripts run Megatron's ``pretrain()`` (``ENTRY`` = ``megatron_lrmoe/testing/cpu_pretrain.py``)
on mock data in fp32 (``LRMOE_CPU_FP32``), GBS 4 / MBS 1: 4 micro-batches per iteration, so the
forwards of several micro-batches are in flight on a stage before their backwards run.

* ``examples/qwen3_30b_a3b/pretrain.sh``: 4 MoE layers, each stage two virtual stages of one
  layer (``--num-layers-per-virtual-pipeline-stage 1``, Megatron's interleaved schedule). Stock
  against LRMoE keep 1.0 (with the fused ``main_grad`` accumulation the script turns on without
  TE): the same losses, gradient norms and validation losses at every iteration. LRMoE keep 0.5
  ``sample`` trains (falling loss, first loss stock's) and its statistics are reported on the
  last stage (one reduction over all ranks); ``--moe-layer-timing`` prints the MoE layers' time
  (summed over the stages) in every run.
* ``examples/glm45_air/pretrain.sh``: 1 dense + 3 MoE layers split 2 / 2 (its uneven-stage
  flags) and the MTP layer on the last stage, with the shared expert and the sigmoid router
  with expert bias. Stock against LRMoE keep 1.0: the same losses, MTP losses, gradient norms
  and validation losses.
"""

from __future__ import annotations

import math
import re
import subprocess

import pytest
from cpu_launch import ROOT, assert_same_curves, curves, launch_env, model_report

TIMEOUT_S = 600  # a hang guard per run, start-up on a busy machine included
ITERS = 4

COMMON = dict(
    LRMOE_CPU_FP32="1", NUM_LAYERS="4", PP="2", EP="1", TP="1", GPUS_PER_NODE="2", NNODES="1",
    MBS="1", GBS="4", TRAIN_ITERS=str(ITERS), EVAL_INTERVAL="2", TRANSFORMER_IMPL="local",
)  # fmt: skip
SIZES = [
    "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-query-groups", "2",
    "--kv-channels", "16", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--max-position-embeddings", "64", "--vocab-size", "512",
    "--moe-layer-timing",
]  # fmt: skip
SCRIPTS = {
    "qwen3": (
        "qwen3_30b_a3b/pretrain.sh",
        {"SEQ_LENGTH": "32"},
        ["--num-attention-heads", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    "glm": (
        "glm45_air/pretrain.sh",
        {"SEQ_LENGTH": "64", "PP_FIRST": "2", "PP_LAST": "2"},
        ["--num-attention-heads", "8", "--moe-shared-expert-intermediate-size", "32"],
    ),
}
LRMOE = {
    "stock": {"LRMOE": "0"},
    "keep1": {"LRMOE": "1", "KEEP_RATIO": "1.0"},
    "keep0.5": {"LRMOE": "1", "KEEP_RATIO": "0.5"},
}
RUNS = [("qwen3", "stock"), ("qwen3", "keep1"), ("qwen3", "keep0.5"), ("glm", "stock"),
        ("glm", "keep1")]  # fmt: skip
_KEPT = re.compile(r"iteration\s+(\d+)/\s*\d+ \| lrmoe kept: ([\d.]+) \|")
_MOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([\d.]+) ms/iter \|")


@pytest.fixture(scope="module")
def logs() -> dict[tuple[str, str], str]:
    """Every run's log, by (script, variant); one run at a time (2 ranks each: a 2-core machine
    gains nothing from more processes at once, and a busy one holds them in memory)."""
    out = {}
    for script, variant in RUNS:
        path, env, flags = SCRIPTS[script]
        proc = subprocess.run(
            ["bash", str(ROOT / "examples" / path), *SIZES, *flags],
            env=launch_env(**COMMON, **env, **LRMOE[variant]), timeout=TIMEOUT_S,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        out[script, variant] = proc.stdout
        assert proc.returncode == 0, f"{(script, variant)}:\n{proc.stdout[-3000:]}"
    return out


def test_runs_are_pipelined(logs: dict[tuple[str, str], str]) -> None:
    virtual = {"qwen3": "2", "glm": "None"}
    # Rank 0 (the first stage) holds two of qwen3's four MoE layers (one per virtual stage), and
    # glm's dense layer and first MoE layer; glm's MTP layer is on the last stage.
    first_stage = {"qwen3": ("2", "0"), "glm": ("1", "0")}
    for (script, variant), log in logs.items():
        for flag, value in (
            ("pipeline_model_parallel_size", "2"),
            ("virtual_pipeline_model_parallel_size", virtual[script]),
            ("num_layers", "4"),
            ("bf16", "False"),
        ):
            assert re.search(rf"^  {flag} \.+ {value}$", log, re.M), (script, variant, flag)
        report = model_report(log)
        layer = "MoELayer" if variant == "stock" else "LRMoELayer"
        moe, mtp = first_stage[script]
        assert report["moe_layers"] == f"{layer}:{moe}", (script, variant, report)
        assert report["mtp_layers"] == mtp, (script, variant, report)
        assert len(curves(log)["lm"]) == ITERS, (script, variant)


@pytest.mark.parametrize("script", ["qwen3", "glm"])
def test_keep1_equals_stock(logs: dict[tuple[str, str], str], script: str) -> None:
    stock, keep1 = curves(logs[script, "stock"]), curves(logs[script, "keep1"])
    keys = ("lm", "mtp", "grad_norm", "val") if script == "glm" else ("lm", "grad_norm", "val")
    assert_same_curves(keep1, stock, keys)


def test_keep_half_trains_and_reports(logs: dict[tuple[str, str], str]) -> None:
    log = logs["qwen3", "keep0.5"]
    half, stock = curves(log), curves(logs["qwen3", "stock"])
    assert all(math.isfinite(v) for v in half["lm"] + half["val"])
    assert half["lm"][0] == pytest.approx(stock["lm"][0], rel=1e-5)  # the forward is exact
    assert half["lm"][-1] < half["lm"][0]
    kept = [float(v) for _, v in _KEPT.findall(log)]
    assert len(kept) == ITERS and all(0.45 < k < 0.6 for k in kept), kept
    assert "lrmoe kept" not in logs["qwen3", "stock"]
    # Every run, stock included, prints the MoE layers' time (summed over the two stages).
    for key, text in logs.items():
        moe = [float(v) for _, v in _MOE.findall(text)]
        assert len(moe) == ITERS and all(ms > 0 for ms in moe), (key, moe)
