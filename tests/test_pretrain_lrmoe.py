"""CPU smoke of the training entry point ``pretrain_lrmoe.py`` and its compat fixes.

megatron.training skips model-parallel set-up without a GPU, so ``pretrain()`` itself cannot run
here. The smoke runs everything around it on 2 gloo ranks (EP=2): Megatron's
``parse_and_validate_args`` with the entry point's ``extra_args_provider``, the entry point's
checks, the model config and config container, the model built by the builder the container
names, and the dataset provider on a real indexed dataset (and on mock data).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_launch import free_port

from megatron_lrmoe.training import compat
from megatron_lrmoe.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
SEQ = 32

ARGV = [
    "--num-layers", "3", "--moe-layer-freq", "([0]+[1]*2)", "--mtp-num-layers", "1",
    "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "64",
    "--normalization", "RMSNorm", "--qk-layernorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
    "--tokenizer-type", "NullTokenizer", "--null-tokenizer-eod-id", "256", "--vocab-size", "257",
    "--split", "90,10,0", "--eval-iters", "1", "--eval-interval", "2",
    # CPU: no TE, no apex, no CUDA fusions.
    "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--lrmoe", "--lrmoe-keep-ratio", "0.5",
]  # fmt: skip


def _load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small byte-level indexed dataset over this repository's Python sources."""
    make = _load_example("make_indexed_dataset")
    prefix = str(tmp_path_factory.mktemp("data") / "repo_bytes")
    files = sorted((ROOT / "megatron_lrmoe").rglob("*.py"))
    make.write_indexed_dataset(make.byte_documents(files, 400_000), prefix)
    return prefix


def test_make_indexed_dataset_round_trip(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    make = _load_example("make_indexed_dataset")
    texts = ["héllo wörld\n", "", "second document"]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    summary = make.write_indexed_dataset(make.byte_documents(files, 10**6), str(tmp_path / "d"))
    dataset = IndexedDataset(str(tmp_path / "d"))
    assert summary["documents"] == len(dataset) == 2  # the empty file is skipped
    for i, text in enumerate(t for t in texts if t):
        want = list(text.encode("utf-8")) + [make.EOD_TOKEN]
        assert dataset[i].tolist() == want
    cut = make.write_indexed_dataset(make.byte_documents(files, 5), str(tmp_path / "c"))
    assert cut["tokens"] == 5 + 1


def _entry_point_worker(rank: int, world_size: int, data_prefix: str, cache: str) -> dict:
    from megatron.training import get_tokenizer
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelConfig

    import pretrain_lrmoe as entry
    from megatron_lrmoe import LRMoEConfig, LRMoELayer
    from megatron_lrmoe.training.model import LRMoEGPTModelConfig, gpt_model_config_from_args
    from megatron_lrmoe.testing import init_megatron_parallel

    facts: dict[str, Any] = {"helpers_patched": compat.use_prebuilt_dataset_helpers()}
    sys.argv = ["pretrain_lrmoe.py", *ARGV, "--data-path", data_prefix, "--data-cache-path", cache]
    args = parse_and_validate_args(
        extra_args_provider=entry.extra_args_provider,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    entry.check_args(args)
    init_megatron_parallel(ep=world_size)

    stock_args = argparse.Namespace(**{**vars(args), "lrmoe": False, "lrmoe_keep_ratio": None})
    facts["stock_config"] = type(gpt_model_config_from_args(stock_args)) is GPTModelConfig
    model_config = gpt_model_config_from_args(args)
    container = pretrain_cfg_container_from_args(args, model_config)
    facts["config"] = type(container.model) is LRMoEGPTModelConfig
    facts["lrmoe"] = container.model.lrmoe == LRMoEConfig(keep_ratio=0.5, seed=args.seed)

    from megatron.core.process_groups_config import ProcessGroupCollection

    builder = container.model.get_builder_cls()(container.model)
    model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups())
    facts["moe_layers"] = [
        type(m).__name__ for m in model.modules() if type(m).__name__.endswith("MoELayer")
    ]
    facts["keep_ratios"] = [
        m.lrmoe_config.keep_ratio for m in model.modules() if isinstance(m, LRMoELayer)
    ]

    train, valid, test = entry.train_valid_test_datasets_provider([8, 2, 0])
    sample = train[0]
    facts["dataset"] = type(train).__name__
    facts["sample_keys"] = sorted(sample)
    facts["tokens_shape"] = tuple(sample["tokens"].shape)
    facts["token_max"] = int(sample["tokens"].max())
    facts["labels_shifted"] = bool(torch.equal(sample["tokens"][1:], sample["labels"][:-1]))
    facts["valid_len"] = len(valid) if valid is not None else 0

    args.mock_data = True
    mock = entry.build_gpt_datasets(args, get_tokenizer(), [4, 0, 0])[0]
    facts["mock"] = (type(mock).__name__, tuple(mock[0]["tokens"].shape))

    losses = torch.tensor([[1.0, 2.0, 3.0]])
    loss, num_tokens, report = entry.loss_func(torch.tensor([[1.0, 0.0, 1.0]]), losses)
    facts["loss"] = (float(loss), int(num_tokens), report["lm loss"].tolist())
    return facts


@pytest.fixture(scope="module")
def entry_facts(data_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cache = str(tmp_path_factory.mktemp("cache"))
    return run_distributed(_entry_point_worker, 2, data_prefix, cache, timeout=TIMEOUT_S)


def test_entry_point_builds_lrmoe_model(entry_facts: list[dict]) -> None:
    for facts in entry_facts:
        assert facts["helpers_patched"]
        assert facts["stock_config"] and facts["config"] and facts["lrmoe"]
        # Two decoder MoE layers and the MTP layer's MoE.
        assert facts["moe_layers"] == ["LRMoELayer"] * 3
        assert facts["keep_ratios"] == [0.5] * 3


def test_entry_point_datasets(entry_facts: list[dict]) -> None:
    for facts in entry_facts:
        assert facts["dataset"] == "GPTDataset"
        assert {"tokens", "labels", "loss_mask", "position_ids"} <= set(facts["sample_keys"])
        assert facts["tokens_shape"] == (SEQ,)
        assert facts["token_max"] <= 256 and facts["labels_shifted"]
        assert facts["valid_len"] > 0
        assert facts["mock"] == ("MockGPTDataset", (SEQ,))


def test_loss_func_counts_masked_tokens(entry_facts: list[dict]) -> None:
    assert entry_facts[0]["loss"] == (4.0, 2, [4.0, 2.0])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--moe-expert-capacity-factor", "1.0"],
         "--lrmoe cannot be combined with --moe-expert-capacity-factor 1.0"),
        (["--lrmoe-keep-ratio", "1.5"], "--lrmoe-keep-ratio: LRMoEConfig.keep_ratio (1.5)"),
    ],
    ids=["combination", "value"],
)  # fmt: skip
def test_entry_point_rejects_bad_flags_before_megatron_validates(
    extra: list[str], message: str
) -> None:
    """A bad LRMoE value or combination is the run's first and last word: it comes before
    Megatron's validate_args prints its argument dump, and nothing trains."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_lrmoe.py"), *ARGV, "--mock-data", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"},
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "arguments ------" not in proc.stdout + proc.stderr  # Megatron's dump never printed


# -- compat -------------------------------------------------------------------------------------


@pytest.fixture
def dataset_utils(monkeypatch: pytest.MonkeyPatch) -> Any:
    """megatron.core.datasets.utils with compile_helpers restored after the test."""
    from megatron.core.datasets import utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    return utils


def test_prebuilt_helpers_replace_make(dataset_utils: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    original = dataset_utils.compile_helpers
    assert compat.use_prebuilt_dataset_helpers() is True
    patched = dataset_utils.compile_helpers
    assert patched is not original and patched.__wrapped__ is original
    assert compat.use_prebuilt_dataset_helpers() is True  # idempotent
    assert dataset_utils.compile_helpers is patched

    def no_make(*a: Any, **k: Any) -> None:
        raise AssertionError("make must not run")

    monkeypatch.setattr(subprocess, "run", no_make)
    patched()


def test_missing_helpers_fail_loudly(dataset_utils: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_prebuilt_helpers_error", lambda: ImportError("gone"))
    with pytest.raises(RuntimeError, match="helpers_cpp is missing"):
        compat.use_prebuilt_dataset_helpers()
    # A source checkout with a Makefile keeps Megatron's own compilation.
    monkeypatch.setattr(compat.os.path, "exists", lambda path: True)
    original = dataset_utils.compile_helpers
    assert compat.use_prebuilt_dataset_helpers() is False
    assert dataset_utils.compile_helpers is original


def test_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.check_megatron_core_version()
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.19.1")
    compat.check_megatron_core_version()
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match="needs megatron-core 0.19.x"):
        compat.check_megatron_core_version()


def test_full_validation_fix(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """One validation set: eval_iters reaches Megatron as the list it indexes; the end-of-training
    evaluation is not repeated at an iteration the loop has just evaluated; the test set is read
    for --eval-iters steps (the count as given when the data iterators are built)."""
    import megatron.training as mt
    from megatron.training import training

    calls: list[tuple[str, int, Any]] = []
    current = argparse.Namespace(eval_iters=38)

    def original(prefix: str, fwd: Any, data: Any, model: Any, iteration: int, *a: Any, **kw: Any) -> str:
        calls.append((prefix, iteration, current.eval_iters))
        current.eval_iters = current.eval_iters[0]  # as Megatron's does after its broadcast
        return prefix

    from megatron.training.datasets import data_samplers

    monkeypatch.setattr(training, "evaluate_and_print_results", original)
    for name in ("build_pretraining_data_loader", "build_train_valid_test_data_iterators"):
        monkeypatch.setattr(training, name, getattr(training, name))
    monkeypatch.setattr(data_samplers, "MegatronFullValidationSampler",
                        data_samplers.MegatronFullValidationSampler)
    monkeypatch.setattr(mt, "get_args", lambda: current)
    assert compat.fix_full_validation(argparse.Namespace(full_validation=False)) is False
    assert training.evaluate_and_print_results is original
    args = argparse.Namespace(full_validation=True, multiple_validation_sets=False)
    assert compat.fix_full_validation(args) is True
    assert compat.fix_full_validation(args) is True  # idempotent
    fixed = training.evaluate_and_print_results
    assert fixed is not original and fixed.__wrapped__ is original
    assert fixed("iteration 100", None, None, None, 100) == "iteration 100"
    assert calls == [("iteration 100", 100, [38])] and current.eval_iters == 38
    # The end of training after an evaluation at another iteration evaluates, the test set too.
    assert fixed("iteration 150 on validation set", None, None, None, 150) is not None
    assert fixed("iteration 150 on test set", None, None, None, 150) is not None
    fixed("iteration 200", None, None, None, iteration=200)
    assert fixed("iteration 200 on validation set", None, None, None, 200) is None
    assert [c[:2] for c in calls] == [
        ("iteration 100", 100), ("iteration 150 on validation set", 150),
        ("iteration 150 on test set", 150), ("iteration 200", 200)]
    assert "not repeated" in capsys.readouterr().out
    assert data_samplers.MegatronFullValidationSampler is compat.MicroBatchFullValidationSampler
    for name in ("build_pretraining_data_loader", "build_train_valid_test_data_iterators"):
        assert getattr(training, name).__wrapped__ is not None, name


def test_full_validation_refuses_ranks_without_a_validation_set() -> None:
    for layout in (dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=4),
                   dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)):
        args = argparse.Namespace(full_validation=True, multiple_validation_sets=False, **layout)
        with pytest.raises(ValueError, match="build no validation set"):
            compat.fix_full_validation(args)


@pytest.mark.parametrize(
    "total,dp,mbs,per_step",
    [(1200, 1, 32, 1), (1200, 1, 1, 1), (7, 2, 3, 1), (3, 4, 2, 1), (64, 4, 16, 1),
     (187, 2, 3, 2), (372, 1, 2, 4), (5, 3, 1, 2)],
)  # fmt: skip
def test_full_validation_sampler_reads_every_sequence_once(
    total: int, dp: int, mbs: int, per_step: int
) -> None:
    from megatron.training.datasets.data_samplers import MegatronFullValidationSampler as wheel

    seen: list[int] = []
    lengths = set()
    for rank in range(dp):
        ours = compat.MicroBatchFullValidationSampler(total, rank, dp, mbs, per_step)
        batches = list(ours)
        # Every rank: the same whole number of steps of full batches.
        most = -(-total // dp)
        assert len(batches) == len(ours) == ours.steps * per_step
        assert ours.steps == -(-(-(-most // mbs)) // per_step)
        assert all(len(b) == mbs for b in batches)
        lengths.add(len(ours))
        mine = [i for b in batches for i in b if i is not None]
        assert sum(i is None for b in batches for i in b) == ours.padding
        # Padding only after this rank's last sequence.
        flat = [i for b in batches for i in b]
        assert flat[: len(mine)] == mine and not any(i is not None for i in flat[len(mine) :])
        # The same sequences on the same rank as the wheel's one-sequence batches.
        assert mine == [i for b in wheel(total, rank, dp) for i in b]
        seen += mine
    assert len(lengths) == 1
    assert sorted(seen) == list(range(total))
    assert ours.padding_all_ranks == dp * len(ours) * mbs - total


def test_full_validation_sampler_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.training as mt

    with pytest.raises(ValueError, match="total_samples=0"):
        compat.MicroBatchFullValidationSampler(0, 0, 1, 4)
    with pytest.raises(ValueError, match="data_parallel_rank 2 not in"):
        compat.MicroBatchFullValidationSampler(10, 2, 2, 4)
    with pytest.raises(ValueError, match="micro_batches_per_step 0"):
        compat.MicroBatchFullValidationSampler(10, 0, 2, 4, 0)
    monkeypatch.setattr(mt, "get_args", lambda: argparse.Namespace(
        eval_micro_batch_size=8, micro_batch_size=2, eval_global_batch_size=32,
        data_parallel_size=2))  # fmt: skip
    sampler = compat.MicroBatchFullValidationSampler(100, 0, 2)
    assert (sampler.micro_batch_size, sampler.micro_batches_per_step) == (8, 2)
    assert "sequences: 100 | data-parallel ranks: 2 | micro-batches per rank: 8 of 8" in (
        sampler.describe()
    )


def test_padded_validation_set() -> None:
    class Split:
        index_split = "valid"

        def __len__(self) -> int:
            return 3

        def __getitem__(self, idx: int) -> dict:
            return {"tokens": torch.full((4,), idx), "loss_mask": torch.ones(4)}

    padded = compat.PaddedValidationSet(Split())
    assert len(padded) == 3 and padded.index_split == "valid"
    assert padded[2]["tokens"].tolist() == [2] * 4 and padded[2]["loss_mask"].sum() == 4
    assert padded[None]["tokens"].tolist() == [0] * 4 and padded[None]["loss_mask"].sum() == 0
    assert not hasattr(padded, "__getitems__")
    with pytest.raises(ValueError, match="no 'loss_mask'"):
        compat.PaddedValidationSet([{"tokens": torch.zeros(2)}])[None]


def test_repair_help_strings() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default=3, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--b", default=4, help="default %(default)s, 50%% of it")
    with pytest.raises(ValueError):
        parser.format_help()
    text = compat.repair_help_strings(parser).format_help()
    assert "1.10 = 10%)." in text and "default 4, 50% of it" in text


def test_transformer_engine_impl_needs_te(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.extensions import transformer_engine

    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
    compat.check_transformer_impl(argparse.Namespace(transformer_impl="local"))
    with pytest.raises(ValueError, match="--transformer-impl local"):
        compat.check_transformer_impl(argparse.Namespace(transformer_impl="transformer_engine"))


# -- example launch scripts ---------------------------------------------------------------------

SCRIPTS = [
    ("qwen3_30b_a3b/pretrain.sh", 16, {}),
    ("qwen3_30b_a3b/pretrain.sh", 16, {"TP": "2"}),
    ("qwen3_30b_a3b/proxy_2xh200.sh", 2, {}),
    ("qwen3_30b_a3b/proxy_2xh200.sh", 2, {"LRMOE": "0"}),
    ("glm45_air/pretrain.sh", 32, {}),
    ("glm45_air/proxy_2xh200.sh", 2, {}),
    ("glm45_air/proxy_2xh200.sh", 2, {"LRMOE": "0"}),
    ("glm45_air/proxy_1xh200.sh", 1, {}),
]


@pytest.mark.parametrize("script, world_size, env", SCRIPTS, ids=lambda v: str(v))
def test_example_script_arguments_validate(
    monkeypatch: pytest.MonkeyPatch, script: str, world_size: int, env: dict[str, str]
) -> None:
    """Each launch script's arguments pass Megatron's validate_args, the entry point's checks
    and, with --lrmoe, LRMoE's per-layer check of the resulting TransformerConfig."""
    from megatron.training import arguments

    import pretrain_lrmoe as entry
    from megatron_lrmoe.training.args import lrmoe_config_from_args

    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / script)],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    argv = proc.stdout.splitlines()
    # No GPU here: answer validate_args' device queries as an H200 would.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if int(env.get("TP", "1")) > 1:  # the script exports it (test_scripts_set_max_connections)
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("RANK", "0")
    # Building the TransformerConfig here needs the kernels a CPU has (TE fusions off).
    cpu = ["--transformer-impl", "local", "--no-rope-fusion", "--no-masked-softmax-fusion",
           "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["pretrain_lrmoe.py", *argv, *cpu])
    args = arguments.parse_args(entry.extra_args_provider)
    arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    entry.check_args(args)
    config = arguments.core_transformer_config_from_args(args)
    assert args.moe_token_dispatcher_type == "alltoall" and config.num_moe_experts == 128
    lrmoe = lrmoe_config_from_args(args)
    assert (lrmoe is None) == (env.get("LRMOE") == "0")
    if lrmoe is not None:
        assert lrmoe.keep_ratio == 0.5 and lrmoe.selection == "sample"
        lrmoe.validate_against(config, script)


@pytest.mark.parametrize("tp, want", [("1", "unset"), ("2", "1")])
def test_scripts_set_max_connections(tmp_path: Path, tp: str, want: str) -> None:
    """With tensor parallelism the launch scripts export CUDA_DEVICE_MAX_CONNECTIONS=1, which
    Megatron's validate_args requires before Blackwell (a user's own value is kept)."""
    entry = tmp_path / "print_env.py"
    entry.write_text(
        "import os\n"
        "print('MAX_CONNECTIONS', os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset'))\n"
    )
    unset = ("CUDA_DEVICE_MAX_CONNECTIONS", "DRY_RUN")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(ENTRY=str(entry), PYTHON=sys.executable, GPUS_PER_NODE="1", NNODES="1", TP=tp)
    runs = [(script, None) for script in ("qwen3_30b_a3b/pretrain.sh", "glm45_air/pretrain.sh")]
    if tp != "1":
        runs.append(("qwen3_30b_a3b/pretrain.sh", "32"))  # the user's own value stays
    for script, own in runs:
        run_env = {**env, "MASTER_PORT": str(free_port())}
        if own is not None:
            run_env["CUDA_DEVICE_MAX_CONNECTIONS"] = own
        proc = subprocess.run(
            ["bash", str(ROOT / "examples" / script)], env=run_env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"MAX_CONNECTIONS {own or want}" in proc.stdout, (script, proc.stdout)


# -- LRMoE statistics in the training log -------------------------------------------------------


def test_main_refuses_two_memory_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """--memory-cap-gib and --gpu-memory-gib both limit the GPU's memory: one is asked for."""
    import pretrain_lrmoe as entry

    args = argparse.Namespace(lrmoe=False, memory_cap_gib=78.0, gpu_memory_gib=79.18)
    monkeypatch.setattr(compat, "use_prebuilt_dataset_helpers", lambda: True)
    monkeypatch.setattr(compat, "fix_full_validation", lambda a: None)
    monkeypatch.setattr(entry, "parse_args", lambda provider: args)
    monkeypatch.setattr(entry, "parse_and_validate_args", lambda **kwargs: args)
    monkeypatch.setattr(entry, "check_args", lambda a: None)
    with pytest.raises(SystemExit, match=r"--memory-cap-gib \(78.0\) and --gpu-memory-gib"):
        entry.main()


@pytest.mark.parametrize("lrmoe", [True, False], ids=["lrmoe", "stock"])
def test_main_installs_training_log_only_with_lrmoe(
    monkeypatch: pytest.MonkeyPatch, lrmoe: bool
) -> None:
    """``main`` wraps megatron.training's train / training_log before ``pretrain`` runs, and only
    with --lrmoe (the wrappers themselves: tests/test_training_hooks.py)."""
    from megatron.training import training

    import pretrain_lrmoe as entry

    monkeypatch.setattr(training, "train", training.train)
    monkeypatch.setattr(training, "training_log", training.training_log)
    original = training.training_log
    args = argparse.Namespace(lrmoe=lrmoe, memory_cap_gib=None, gpu_memory_gib=None)
    monkeypatch.setattr(compat, "use_prebuilt_dataset_helpers", lambda: True)
    monkeypatch.setattr(entry, "parse_args", lambda provider: args)  # the early check's parse
    monkeypatch.setattr(entry, "parse_and_validate_args", lambda **kwargs: args)
    monkeypatch.setattr(entry, "check_args", lambda a: None)
    monkeypatch.setattr(entry, "gpt_model_config_from_args", lambda a: "model config")
    monkeypatch.setattr(entry, "pretrain_cfg_container_from_args", lambda a, m: "container")
    seen: dict[str, Any] = {}

    def fake_pretrain(container: Any, *rest: Any, **kwargs: Any) -> None:
        seen["container"] = container
        seen["wrapped"] = hasattr(training.training_log, "__lrmoe_training_log__")
        seen["train_wrapped"] = hasattr(training.train, "__lrmoe_training_log__")

    monkeypatch.setattr(
        entry.inprocess_restart, "maybe_wrap_for_inprocess_restart", lambda p: (fake_pretrain, None)
    )
    entry.main()
    assert seen == {"container": "container", "wrapped": lrmoe, "train_wrapped": lrmoe}
    if not lrmoe:
        assert training.training_log is original
