"""``megatron_lrmoe.training.hooks``: LRMoE statistics in megatron.training's log.

A full ``pretrain`` loop needs a GPU, so the wrappers run here inside a stand-in for
``megatron.training.training``: a module whose ``pretrain``, ``train`` and ``training_log`` have
0.19.2's parameters and call each other by global name, as Megatron's do (``train`` calls
``training_log(...)`` after every iteration with the same arguments; ``training_log`` prints an
iteration line on log iterations). Megatron's ``get_args`` and writers are replaced by fakes.
The in-process tests use a model of fake ``LRMoELayer`` subclasses with known ``CallStats``;
the last test trains a real tiny LRMoE GPT on 2 gloo ranks through the same stand-in. The
install tests also check the real ``megatron.training.training``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import types
from typing import Any, Optional

import pytest
import torch

from megatron_lrmoe.layer import LRMoELayer
from megatron_lrmoe.training import hooks as training_hooks
from megatron_lrmoe.training.hooks import (
    LRMoETrainingLog,
    check_training_functions,
    install_lrmoe_training_log,
    lrmoe_log_line,
)
from megatron_lrmoe.observe.stats import CallStats, ExchangeStats
from megatron_lrmoe.testing import run_distributed

TIMEOUT_S = 180.0

# The call pattern of megatron.training 0.19.2: pretrain -> train -> training_log per iteration
# (positional arguments as train passes them), a line printed when Megatron prints one.
_FAKE_TRAINING_SOURCE = '''
def pretrain(forward_step_func, model):
    return train(forward_step_func, model, None, None, None, None, None, None, {}, None)


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
          non_loss_data_func, inference_model=None, p2p_communicator=None, pg_collection=None):
    args = get_args()
    iteration = args.iteration
    is_first_iteration = True
    report_memory_flag = True
    while iteration < args.train_iters:
        forward_step_func(model)
        iteration += 1
        report_memory_flag = training_log(
            {}, {}, 1e-3, iteration, 1.0, report_memory_flag, 0, 1.0, None, None, None,
            pg_collection=pg_collection, is_first_iteration=is_first_iteration,
            seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None,
        )
        is_first_iteration = False
    return iteration, 0


def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad,
                 max_attention_logit, pg_collection=None, is_first_iteration=False,
                 seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None):
    args = get_args()
    CALLS.append(iteration)
    if iteration % args.log_interval == 0 or is_first_iteration:
        print_rank_last(f" [stamp] iteration {iteration:8d}/{args.train_iters:8d} | megatron |")
    return False
'''


def fake_training_module() -> types.ModuleType:
    """A stand-in for ``megatron.training.training`` (see the module docstring)."""
    from megatron.training import global_vars
    from megatron.training.utils import print_rank_last

    module = types.ModuleType("fake_megatron_training")
    # Through the module attribute, so that a test's replacement of get_args is seen.
    module.__dict__.update(
        get_args=lambda: global_vars.get_args(), print_rank_last=print_rank_last, CALLS=[]
    )
    exec(_FAKE_TRAINING_SOURCE, module.__dict__)  # noqa: S102 - test fixture source above
    return module


class FakeWriter:
    """TensorBoard ``SummaryWriter`` stand-in: every ``add_scalar`` call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, iteration: int) -> None:
        self.calls.append((name, value, iteration))

    def at(self, iteration: int) -> dict[str, float]:
        return {name: value for name, value, it in self.calls if it == iteration}


class FakeWandb:
    """W&B run stand-in."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((dict(values), step))


class FixedTimer:
    def milliseconds(self) -> dict[str, float]:
        return {"scoring": 1.0, "selection": 0.5}


def _known_call(layer_number: int) -> CallStats:
    """Keep 0.5, a quarter of the score mass dropped, 1000 B sent of 3000 stock, 1.5 ms."""
    stats = CallStats(
        layer_number=layer_number,
        call_index=0,
        total_pairs=100,
        pairs_sent=50,
        quota_per_expert=[25, 25],
        tokens_per_expert=[50, 50],
        kept_pairs_sent=25,
    )
    stats.score_total = torch.tensor(4.0)
    stats.score_kept = torch.tensor(3.0)
    stats.score_added_variance = torch.tensor(1.0)
    stats.exchanges = {
        "grad": ExchangeStats(
            rows=0, bytes=1000, remote_rows=0, remote_bytes=0, stock_rows=0, stock_bytes=3000
        )
    }
    stats.timer = FixedTimer()
    stats.backward_done = True
    return stats


class FakeLRMoELayer(LRMoELayer):
    """An ``LRMoELayer`` (for the metrics' stats listeners) whose calls produce known stats."""

    def __init__(self, layer_number: int) -> None:  # noqa: D107 - no MoELayer construction
        torch.nn.Module.__init__(self)
        self.layer_number = layer_number
        self.last_call_stats: Optional[CallStats] = None
        self.weight = torch.nn.Parameter(torch.ones(1))
        self._step: Optional[int] = None  # set_training_step's state
        self._backwards_in_step = 0
        self._stats_listeners = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.last_call_stats = _known_call(self.layer_number)
        if torch.is_grad_enabled():  # as LRMoELayer.routed_experts_compute hands calls out
            for fn in list(self._stats_listeners.values()):
                fn(self.layer_number, self.last_call_stats)
        return x * self.weight


def fake_model() -> list[torch.nn.Module]:
    """One model chunk with a dense layer and two LRMoE layers (layer numbers 1 and 2)."""
    return [torch.nn.Sequential(torch.nn.Linear(1, 1), FakeLRMoELayer(1), FakeLRMoELayer(2))]


def forward_step(model: list[torch.nn.Module]) -> None:
    """One training call of every layer, and one evaluation call (not recorded)."""
    model[0](torch.ones(1, 1)).sum().backward()
    with torch.no_grad():
        model[0](torch.ones(1, 1))


def megatron_args(**overrides: Any) -> argparse.Namespace:
    values = dict(
        lrmoe=True,
        log_interval=2,
        train_iters=5,
        iteration=0,
        num_layers=2,
        mtp_num_layers=None,
        moe_per_layer_logging=False,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture
def megatron_globals(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set Megatron's args and writers (``set(args, writer, wandb)``); restored afterwards."""
    from megatron.training import global_vars

    def set_globals(args: argparse.Namespace, writer: Any = None, wandb: Any = None) -> None:
        monkeypatch.setattr(global_vars, "get_args", lambda: args)
        monkeypatch.setattr(global_vars, "get_tensorboard_writer", lambda: writer)
        monkeypatch.setattr(global_vars, "get_wandb_writer", lambda: wandb)

    return set_globals


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "iteration" in line]


# -- reporting ----------------------------------------------------------------------------------


def test_reports_at_log_iterations(megatron_globals: Any, capsys: pytest.CaptureFixture) -> None:
    args = megatron_args()
    writer, wandb = FakeWriter(), FakeWandb()
    megatron_globals(args, writer, wandb)
    module = fake_training_module()
    hooks = install_lrmoe_training_log(args, module)
    model = fake_model()

    module.pretrain(forward_step, model)

    assert module.CALLS == [1, 2, 3, 4, 5]  # the original ran every iteration
    # Reports at the first iteration and at every --log-interval, nowhere else.
    assert sorted({it for _, _, it in writer.calls}) == [1, 2, 4]
    assert sorted({step for _, step in wandb.logged}) == [1, 2, 4]
    per_iteration = {
        "lrmoe/kept_ratio": 0.5,
        "lrmoe/dropped_score_fraction": 0.25,
        "lrmoe/backward_bytes": 2 * 1000.0,  # two layers, one training call each per iteration
        "lrmoe/backward_bytes_saved": 2 * 2000.0,
        "lrmoe/overhead_ms": 2 * 1.5,
        "lrmoe/added_variance": 0.25,
    }
    for iteration in (1, 2, 4):
        assert writer.at(iteration) == pytest.approx(per_iteration), iteration
    assert all(name.startswith("lrmoe/") for name, _, _ in writer.calls)
    assert {k: v for values, _ in wandb.logged for k, v in values.items()} == pytest.approx(
        per_iteration
    )
    # Our line right after Megatron's, on log iterations only.
    lines = _lines(capsys.readouterr().out)
    fragment = (
        " lrmoe kept: 0.500 | lrmoe dropped score: 0.250 | lrmoe bwd saved: 3.91 KiB |"
        " lrmoe overhead: 3.0 ms | lrmoe added variance: 0.250 |"
    )
    assert len(lines) == 6
    for (megatron, ours), iteration in zip(zip(lines[::2], lines[1::2]), (1, 2, 4)):
        assert megatron.endswith(f"iteration {iteration:8d}/       5 | megatron |")
        assert ours.startswith(" [") and ours.endswith(
            f"] iteration {iteration:8d}/       5 |{fragment}"
        )
    assert hooks.last_line == lines[-1]
    # After train: no metrics, no forward hooks left on the layers.
    assert hooks.metrics is None
    assert all(not m._forward_hooks for m in model[0].modules())


def test_resumed_run_and_per_layer(megatron_globals: Any, capsys: pytest.CaptureFixture) -> None:
    """A run resumed at iteration 10 reports per iteration since 10; per-layer scalars too."""
    args = megatron_args(iteration=10, train_iters=14, log_interval=3, moe_per_layer_logging=True)
    writer = FakeWriter()
    megatron_globals(args, writer, None)
    module = fake_training_module()
    install_lrmoe_training_log(args, module)

    module.pretrain(forward_step, fake_model())

    assert sorted({it for _, _, it in writer.calls}) == [11, 12]
    for iteration in (11, 12):
        scalars = writer.at(iteration)
        assert scalars["lrmoe/backward_bytes"] == pytest.approx(2000.0)
        for i in (0, 1):
            assert scalars[f"lrmoe/kept_ratio_layer_{i}"] == pytest.approx(0.5)
            assert scalars[f"lrmoe/backward_bytes_layer_{i}"] == pytest.approx(1000.0)
    assert len([line for line in _lines(capsys.readouterr().out) if "lrmoe" in line]) == 2


def test_no_lrmoe_calls_print_nothing(
    megatron_globals: Any, capsys: pytest.CaptureFixture
) -> None:
    """A model without LRMoE layers (and --lrmoe on) joins the reduction, prints no line."""
    args = megatron_args()
    writer = FakeWriter()
    megatron_globals(args, writer, None)
    module = fake_training_module()
    install_lrmoe_training_log(args, module)

    module.pretrain(lambda model: None, [torch.nn.Linear(1, 1)])

    assert writer.calls == []
    assert "lrmoe" not in capsys.readouterr().out


def test_lrmoe_off_changes_nothing(megatron_globals: Any, capsys: pytest.CaptureFixture) -> None:
    args = megatron_args(lrmoe=False)
    writer = FakeWriter()
    megatron_globals(args, writer, None)
    module = fake_training_module()
    train, training_log = module.train, module.training_log

    assert install_lrmoe_training_log(args, module) is None
    assert install_lrmoe_training_log(argparse.Namespace(), module) is None  # no --lrmoe flag
    assert (module.train, module.training_log) == (train, training_log)
    model = fake_model()
    module.pretrain(forward_step, model)
    assert writer.calls == [] and "lrmoe" not in capsys.readouterr().out
    assert all(not m._forward_hooks for m in model[0].modules())


def test_log_line_format() -> None:
    from datetime import datetime

    now = datetime(2025, 1, 2, 3, 4, 5, 6)
    line = lrmoe_log_line(12, 100, " lrmoe kept: 0.500 |", now)
    assert line == " [2025-01-02 03:04:05.000006] iteration       12/     100 | lrmoe kept: 0.500 |"
    assert lrmoe_log_line(3, None, " x |", now).endswith("iteration        3/       ? | x |")


# -- installation -------------------------------------------------------------------------------


def test_install_is_idempotent_and_reversible(megatron_globals: Any) -> None:
    args = megatron_args()
    megatron_globals(args)
    module = fake_training_module()
    train, training_log = module.train, module.training_log

    hooks = install_lrmoe_training_log(args, module)
    wrapped = (module.train, module.training_log)
    assert isinstance(hooks, LRMoETrainingLog)
    assert wrapped[0] is not train and wrapped[1] is not training_log
    assert wrapped[0].__wrapped__ is train and wrapped[1].__wrapped__ is training_log
    assert inspect.signature(wrapped[1]) == inspect.signature(training_log)
    assert install_lrmoe_training_log(args, module) is hooks  # idempotent
    assert (module.train, module.training_log) == wrapped

    module.training_log = training_log  # someone replaced one wrapper
    with pytest.raises(RuntimeError, match="not wrapped together"):
        install_lrmoe_training_log(args, module)
    module.training_log = wrapped[1]
    hooks.uninstall()
    assert (module.train, module.training_log) == (train, training_log)


def test_real_megatron_training_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core 0.19.2's train / training_log pass the checks and get wrapped."""
    from megatron.training import training

    monkeypatch.setattr(training, "train", training.train)
    monkeypatch.setattr(training, "training_log", training.training_log)
    original = training.training_log
    check_training_functions(training)

    assert install_lrmoe_training_log(megatron_args(lrmoe=False)) is None
    assert training.training_log is original
    hooks = install_lrmoe_training_log(megatron_args())
    assert training.training_log.__wrapped__ is original
    assert getattr(training.train, "__lrmoe_training_log__") is hooks
    hooks.uninstall()
    assert training.training_log is original


def test_signature_mismatch_raises(megatron_globals: Any) -> None:
    megatron_globals(megatron_args())
    module = fake_training_module()
    train = module.train

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale):  # noqa
        return False

    module.training_log = training_log
    with pytest.raises(RuntimeError, match=r"training_log has parameters .*0\.19\.2"):
        install_lrmoe_training_log(megatron_args(), module)
    assert module.train is train  # nothing installed

    module = fake_training_module()
    module.train = lambda forward_step_func, model: None
    with pytest.raises(RuntimeError, match="train has parameters"):
        install_lrmoe_training_log(megatron_args(), module)


def test_call_by_global_name_is_checked(megatron_globals: Any) -> None:
    megatron_globals(megatron_args())
    module = fake_training_module()
    exec(  # noqa: S102 - a train that does not call training_log by name
        "def train(forward_step_func, model, optimizer, opt_param_scheduler,"
        " train_data_iterator, valid_data_iterator, process_non_loss_data_func, config,"
        " checkpointing_context, non_loss_data_func, inference_model=None,"
        " p2p_communicator=None, pg_collection=None):\n    return log_it()\n",
        module.__dict__,
    )
    with pytest.raises(RuntimeError, match="train no longer calls training_log"):
        install_lrmoe_training_log(megatron_args(), module)


def test_version_is_checked(megatron_globals: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_lrmoe.training import compat

    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match="needs megatron-core 0.19.x"):
        install_lrmoe_training_log(megatron_args(), fake_training_module())


def test_nothing_on_import() -> None:
    from megatron.training import training

    import pretrain_lrmoe  # noqa: F401

    assert training_hooks.install_lrmoe_training_log is install_lrmoe_training_log

    assert not hasattr(training.train, "__lrmoe_training_log__")
    assert not hasattr(training.training_log, "__lrmoe_training_log__")


# -- real LRMoE layers, 2 ranks -----------------------------------------------------------------


def _pretrain_in_child(args: argparse.Namespace, step: Any, model: Any) -> dict[str, Any]:
    """The stand-in ``pretrain`` with the hooks installed, in a ``run_distributed`` child (whose
    Megatron globals need no restoring); returns the writer's calls and the printed lines."""
    from megatron.training import global_vars

    writer = FakeWriter()
    global_vars.get_args = lambda: args
    global_vars.get_tensorboard_writer = lambda: writer
    global_vars.get_wandb_writer = lambda: None
    module = fake_training_module()
    hooks = install_lrmoe_training_log(args, module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.pretrain(step, model)
    return {"writer": writer.calls, "lines": _lines(out.getvalue()), "last": hooks.last_line}


def _real_layers_worker(rank: int, world_size: int) -> dict[str, Any]:
    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.demo.trainer import ModelShape, Trainer, TrainSettings, load_stdlib_corpus
    from megatron_lrmoe.testing import init_megatron_parallel

    init_megatron_parallel(ep=world_size)
    corpus = load_stdlib_corpus(1 << 20, 64 << 10)
    shape = ModelShape(hidden_size=32, kv_channels=8, moe_ffn_hidden_size=32, seq_length=32)
    settings = TrainSettings(steps=3, micro_batch_size=4, num_microbatches=2, eval_interval=100)
    trainer = Trainer(shape, settings, corpus, lrmoe=LRMoEConfig(keep_ratio=0.5), metrics=False)
    args = megatron_args(train_iters=3, num_layers=trainer.config.num_layers)
    return _pretrain_in_child(args, lambda model: trainer.train_step(), [trainer.model])


def test_real_lrmoe_layers_two_ranks() -> None:
    results = run_distributed(_real_layers_worker, 2, timeout=TIMEOUT_S)
    # The same reduced values on both ranks, at iterations 1 and 2 (of 3, --log-interval 2).
    assert results[0]["writer"] == results[1]["writer"]
    writer = results[0]["writer"]
    assert sorted({it for _, _, it in writer}) == [1, 2]
    for iteration in (1, 2):
        scalars = {name: value for name, value, it in writer if it == iteration}
        assert 0.45 < scalars["lrmoe/kept_ratio"] < 0.55
        assert 0.0 < scalars["lrmoe/dropped_score_fraction"] < 1.0
        assert scalars["lrmoe/backward_bytes_saved"] > 0
        assert scalars["lrmoe/overhead_ms"] > 0
    # Printed on the last rank only (print_rank_last), right after Megatron's line.
    assert [line for line in results[0]["lines"] if "lrmoe" in line] == []
    lines = results[1]["lines"]
    assert len(lines) == 4 and all("lrmoe kept: 0." in line for line in lines[1::2])
    assert lines[3] == results[1]["last"]


def test_training_step_reaches_the_layers() -> None:
    """train() starts the layers at args.iteration; training_log(iteration) moves them on."""
    from megatron_lrmoe import set_lrmoe_training_step

    model = fake_model()
    assert set_lrmoe_training_step(model, 7) == 2
    layers = [m for m in model[0].modules() if isinstance(m, FakeLRMoELayer)]
    assert all(layer._step == 7 and layer._backwards_in_step == 0 for layer in layers)


# -- --moe-layer-timing over pipeline stages, 2 ranks --------------------------------------------

_STAGE_SECONDS = (0.06, 0.01)  # each stage's one MoE layer sleeps this long per forward


def _pipeline_timing_worker(rank: int, world_size: int) -> dict[str, Any]:
    import time

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)

    class SlowLayer(FakeLRMoELayer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            time.sleep(_STAGE_SECONDS[rank])
            return super().forward(x)

    model = [torch.nn.Sequential(torch.nn.Linear(1, 1), SlowLayer(rank + 1))]
    args = megatron_args(lrmoe=False, moe_layer_timing=True, log_interval=1, train_iters=3)
    return _pretrain_in_child(args, forward_step, model)


def test_moe_layer_timing_sums_the_pipeline_stages() -> None:
    """With pipeline parallelism the last stage's line covers every stage's MoE layers."""
    results = run_distributed(_pipeline_timing_worker, 2, timeout=TIMEOUT_S)
    assert results[0]["writer"] == results[1]["writer"]  # the same reduced values on every stage
    per_iteration = [v for name, v, _ in results[0]["writer"] if name.endswith("ms_per_iteration")]
    cumulative = [v for name, v, _ in results[0]["writer"] if name.endswith("seconds_cumulative")]
    assert len(per_iteration) == len(cumulative) == 3
    # Wall clock on CPU: at least both stages' sleeps (the last stage's own is 10 ms).
    assert all(ms >= 1e3 * sum(_STAGE_SECONDS) for ms in per_iteration), per_iteration
    assert cumulative == pytest.approx([sum(per_iteration[: i + 1]) / 1e3 for i in range(3)])
    assert results[0]["lines"] == []  # printed on the last rank only
    line = results[1]["last"]
    assert f"moe layers: {per_iteration[-1]:.1f} ms/iter" in line
    assert f"moe layers cumulative: {cumulative[-1]:.3f} s |" in line


def test_trace_dir_records_during_train_and_closes(
    megatron_globals: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``--lrmoe-trace-dir``: the train wrapper installs the routing recorder on the model being
    trained, gives it every iteration's step, and closes it when train returns."""
    from megatron_lrmoe.training import hooks as hooks_module

    events: list[Any] = []

    class Recorder:
        def set_step(self, step: int) -> None:
            events.append(("step", step))

        def close(self) -> None:
            events.append("closed")

    def install(model: Any, directory: Any) -> Recorder:
        events.append(("installed", len(model), directory))
        return Recorder()

    monkeypatch.setattr(hooks_module, "install_trace_recorder", install)
    args = megatron_args(lrmoe_trace_dir=str(tmp_path))
    megatron_globals(args)
    module = fake_training_module()
    install_lrmoe_training_log(args, module)
    module.pretrain(forward_step, fake_model())
    assert events[0] == ("installed", 1, str(tmp_path))
    assert [e for e in events if isinstance(e, tuple) and e[0] == "step"] == [
        ("step", i) for i in range(1, 6)
    ]
    assert events[-1] == "closed"
