"""``--full-validation`` end to end: ``pretrain_lrmoe.py`` in Megatron's own loop, on CPU.

``examples/qwen3_30b_a3b/pretrain.sh`` runs tiny on 2 gloo ranks (EP 2, so data-parallel 2) on
an indexed dataset of 20 documents, with ``compat.fix_full_validation`` doing what
``benchmarks/memory_bound.py converge`` relies on. Two runs train identically and evaluate the
same validation set in different micro-batches:

* ``mbs3``: ``--eval-micro-batch-size 3 --eval-global-batch-size 12``, two micro-batches per
  evaluation step on each rank. The ranks' shares of the set take 32 and 31 micro-batches of 3,
  so the sampler pads (the second rank with a batch of padding, both to a whole number of
  steps), and a test split is read after training.
* ``mbs8``: ``--eval-micro-batch-size 8 --eval-global-batch-size 16``, one micro-batch per step
  (the protocol's layout: ``memory_bound.py`` passes 32 / 32 on one GPU).

From the logs: every evaluation reads each validation sequence once (the start-up plan's
micro-batches per rank are ceil(sequences / DP / micro-batch), rounded up to whole steps, and the
per-sequence spread that ``pretrain_lrmoe.loss_func`` counts after exactly that many micro-batches
reports the set's size: padding adds no sequence, no sequence is read twice); the two batchings
give the same validation losses; the end-of-training evaluation is not repeated; the test set is
read for ``--eval-iters`` steps; and the runs finish.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cpu_launch import ROOT, curves, launch_env

TIMEOUT_S = 600  # a hang guard per run, start-up on a busy machine included
ITERS, EVAL_INTERVAL, EVAL_ITERS = 4, 2, 1
DP = 2
DOCUMENTS, DOCUMENT_BYTES = 20, 3000
SIZES = [
    "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--kv-channels", "16", "--num-experts", "8",
    "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--max-position-embeddings", "64",
    "--vocab-size", "512",
]  # fmt: skip
SPLIT = "70,20,10"
RUNS = {"mbs3": (3, 12), "mbs8": (8, 16)}  # --eval-micro-batch-size, --eval-global-batch-size

_PLAN = re.compile(
    r" full validation \| sequences: (\d+) \| data-parallel ranks: (\d+) \| micro-batches per "
    r"rank: (\d+) of (\d+) \| steps: (\d+) of (\d+) micro-batches \| padding sequences: (\d+) \|"
)
# A spread line and the validation (or test) line of the same evaluation.
_EVALUATION = re.compile(
    r"validation spread \| sequences: (\d+) \|.*\n(?:.*\n)*? validation loss at iteration (\d+)"
    r"( on \w+ set)? \|"
)


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Byte-level documents of fixed length from this repository's sources (fixed sizes: the
    validation set's sequence count does not move when the sources change)."""
    spec = importlib.util.spec_from_file_location(
        "make_indexed_dataset", ROOT / "examples" / "make_indexed_dataset.py"
    )
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    texts = [
        data[:DOCUMENT_BYTES]
        for data in (p.read_bytes() for p in sorted((ROOT / "megatron_lrmoe").rglob("*.py")))
        if len(data) >= DOCUMENT_BYTES
    ][:DOCUMENTS]
    assert len(texts) == DOCUMENTS
    documents = [
        np.append(np.frombuffer(t, np.uint8), make.EOD_TOKEN).astype(np.uint16) for t in texts
    ]
    prefix = str(tmp_path_factory.mktemp("full_validation_data") / "repo_bytes")
    make.write_indexed_dataset(documents, prefix)
    return prefix


@pytest.fixture(scope="module")
def logs(data_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each run's log (one run at a time: two ranks already fill a 2-core machine)."""
    out = {}
    for name, (mbs, gbs) in RUNS.items():
        env = launch_env(
            LRMOE_CPU_FP32="1", NUM_LAYERS="2", GPUS_PER_NODE=str(DP), NNODES="1", TP="1",
            PP="1", EP=str(DP), MBS="2", GBS="8", SEQ_LENGTH="64", TRAIN_ITERS=str(ITERS),
            EVAL_INTERVAL=str(EVAL_INTERVAL), EVAL_ITERS=str(EVAL_ITERS),
            TRANSFORMER_IMPL="local", DATA_PREFIX=data_prefix,
            DATA_CACHE=str(tmp_path_factory.mktemp(f"cache_{name}")),
        )  # fmt: skip
        flags = [
            *SIZES, "--split", SPLIT, "--full-validation",
            "--eval-micro-batch-size", str(mbs), "--eval-global-batch-size", str(gbs),
        ]  # fmt: skip
        proc = subprocess.run(
            ["bash", str(ROOT / "examples" / "qwen3_30b_a3b" / "pretrain.sh"), *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-4000:]}"
        out[name] = proc.stdout
    return out


def _plan(log: str) -> dict[str, int]:
    plans = set(_PLAN.findall(log))
    assert len(plans) == 1, plans
    keys = ("sequences", "dp", "micro_batches", "mbs", "steps", "per_step", "padding")
    return dict(zip(keys, map(int, plans.pop())))


def _validation_samples(log: str) -> int:
    """The validation set's sequences, as megatron-core's dataset builder reports them."""
    after = log[log.index("GPTDataset valid indices") :]
    return int(re.search(r"> total number of samples: (\d+)", after).group(1))


def _evaluations(log: str) -> list[tuple[int, int, str]]:
    """(sequences, iteration, "" / " on validation set" / " on test set") per evaluation."""
    return [(int(n), int(it), where) for n, it, where in _EVALUATION.findall(log)]


@pytest.mark.parametrize("name", RUNS)
def test_every_evaluation_reads_each_sequence_once(logs: dict[str, str], name: str) -> None:
    log = logs[name]
    mbs, gbs = RUNS[name]
    plan = _plan(log)
    valid = _validation_samples(log)
    per_step = gbs // (mbs * DP)
    most = -(-valid // DP)  # the larger rank share
    steps = -(-(-(-most // mbs)) // per_step)
    assert plan == {
        "sequences": valid, "dp": DP, "micro_batches": steps * per_step, "mbs": mbs,
        "steps": steps, "per_step": per_step, "padding": DP * steps * per_step * mbs - valid,
    }  # fmt: skip
    inside = [e for e in _evaluations(log) if not e[2]]
    # Each evaluation inside the loop, each preceded by its own spread line: the spread is
    # reported after the plan's micro-batches, and counts exactly the set's sequences.
    assert [it for _, it, _ in inside] == list(range(EVAL_INTERVAL, ITERS + 1, EVAL_INTERVAL))
    assert [n for n, _, _ in inside] == [valid] * len(inside)
    assert log.count("validation spread |") == len(_evaluations(log))


def test_padding_sequences_are_exercised(logs: dict[str, str]) -> None:
    """mbs3: the ranks' shares need 32 and 31 micro-batches; both run 32 (the second one batch
    of padding only), which the wheel's cyclic iterator would have filled by reading the second
    rank's first batch again."""
    plan = _plan(logs["mbs3"])
    shares = [len(range(r, plan["sequences"], DP)) for r in range(DP)]
    batches = [-(-s // plan["mbs"]) for s in shares]
    assert max(batches) > min(batches) and plan["padding"] >= plan["mbs"]


def test_batchings_give_the_same_validation_loss(logs: dict[str, str]) -> None:
    """Same training, same set, different micro-batches (and padding): the same loss (fp32; the
    printed 7 digits, GEMMs of other shapes round differently)."""
    got = {name: curves(log) for name, log in logs.items()}
    for name in RUNS:
        assert got[name]["lm"] == pytest.approx(got["mbs8"]["lm"], rel=1e-6), name
        assert len(got[name]["val"]) == ITERS // EVAL_INTERVAL + 1, name  # + the test set
        assert all(math.isfinite(v) for v in got[name]["val"]), name
    inside = ITERS // EVAL_INTERVAL
    assert got["mbs3"]["val"][:inside] == pytest.approx(got["mbs8"]["val"][:inside], rel=1e-5)


@pytest.mark.parametrize("name", RUNS)
def test_final_evaluation_not_repeated_and_run_finishes(logs: dict[str, str], name: str) -> None:
    log = logs[name]
    assert f"validation at iteration {ITERS} on validation set: not repeated" in log
    assert not [e for e in _evaluations(log) if e[2] == " on validation set"]
    assert re.search(rf"iteration\s+{ITERS}/\s*{ITERS} \|", log)
    assert "cpu_pretrain model: moe_layers=LRMoELayer:2" in log  # train() returned


@pytest.mark.parametrize("name", RUNS)
def test_test_set_reads_eval_iters_steps(logs: dict[str, str], name: str) -> None:
    """The test split is read for --eval-iters steps of --eval-global-batch-size sequences, not
    for as many steps as the validation set takes."""
    _, gbs = RUNS[name]
    tests = [e for e in _evaluations(logs[name]) if e[2] == " on test set"]
    assert [(n, it) for n, it, _ in tests] == [(EVAL_ITERS * gbs, ITERS)]
