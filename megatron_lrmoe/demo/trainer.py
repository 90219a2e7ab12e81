"""Train a tiny Qwen3-style MoE GPT with megatron.core directly (the demo's and tests' loop).

``megatron.training`` skips model-parallel set-up when no GPU is present
(``_initialize_distributed`` calls ``initialize_model_parallel`` only ``if device_count > 0``), so
this module drives megatron.core itself, with the same pieces a ``pretrain_gpt.py`` run uses:
``GPTModel`` built from ``get_gpt_decoder_block_spec(..., use_transformer_engine=False)`` (made
LRMoE by :func:`megatron_lrmoe.lrmoe_decoder_block_spec` when asked), Megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam), ``OptimizerParamScheduler`` and
``forward_backward_no_pipelining``. Every LRMoE piece is the one the GPU path uses; on CPU the
test-only CUDA shim (``megatron_lrmoe.testing.install_cpu_shim``) must be installed first, which
``megatron_lrmoe.testing.run_distributed`` does in its ranks. With it, Megatron's DDP and its
(non-distributed) Adam optimizer run unchanged on CPU/gloo. Checkpoints go through
``megatron.core.dist_checkpointing`` (torch_dist): the model's ``sharded_state_dict`` and, when
asked, the optimizer's (see :func:`save_checkpoint`), for stock and LRMoE models alike.

Data: byte-level tokens (vocab 256) of the Python standard library's own ``.py`` sources under
``sysconfig.get_paths()["stdlib"]``, which exist offline on every machine that runs Python. Files
are split into train and validation by a fixed hash of their relative path.

Shape legend: B micro-batch size, S sequence length, V vocab (256).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_lrmoe.layer import set_lrmoe_training_step
from megatron_lrmoe.config import LRMoEConfig

if TYPE_CHECKING:  # pragma: no cover - typing only
    from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ByteCorpus",
    "MoELayerProbe",
    "ModelShape",
    "StepRecord",
    "TrainSettings",
    "Trainer",
    "build_gpt_model",
    "load_checkpoint",
    "load_stdlib_corpus",
    "qwen3_style_config",
    "save_checkpoint",
    "stdlib_source_files",
]

VOCAB_SIZE = 256
# Directories under the stdlib path that are not the standard library's own sources.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")
# One file in this many goes to validation (chosen by a hash of its relative path).
_VALID_EVERY = 16


# ------------------------------------------------------------------------------------------------
# Data.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation byte streams.

    Attributes:
        train: ``[N_train]`` uint8 bytes of the training files, separated by a newline.
        valid: ``[N_valid]`` uint8 bytes of the validation files.
        train_files: Number of training files read.
        valid_files: Number of validation files read.
        root: Directory the files came from.
    """

    train: torch.Tensor
    valid: torch.Tensor
    train_files: int
    valid_files: int
    root: str

    def train_batch(self, generator: torch.Generator, batch: int, seq: int) -> torch.Tensor:
        """``[B, S+1]`` int64 windows at random offsets of the training stream."""
        starts = torch.randint(0, self.train.numel() - seq - 1, (batch,), generator=generator)
        return _windows(self.train, starts, seq)

    def valid_batches(self, num: int, batch: int, seq: int, shard: int, shards: int) -> list:
        """``num`` fixed ``[B, S+1]`` validation batches of one shard (evenly spaced windows).

        Every shard gets different windows, so data-parallel ranks together cover
        ``shards * num * batch`` windows; the same arguments always give the same batches.
        """
        total = num * batch * shards
        span = self.valid.numel() - seq - 1
        starts = torch.linspace(0, span, total).long().reshape(shards, num, batch)[shard]
        return [_windows(self.valid, s, seq) for s in starts]


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    index = starts.unsqueeze(1) + torch.arange(seq + 1).unsqueeze(0)
    return stream[index].long()


def stdlib_source_files(root: Optional[str] = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path (site-packages excluded)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in base.rglob("*.py")
        if p.is_file() and not any(part in _NOT_STDLIB for part in p.relative_to(base).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def load_stdlib_corpus(
    max_train_bytes: int = 4 << 20, max_valid_bytes: int = 256 << 10, root: Optional[str] = None
) -> ByteCorpus:
    """Read the standard library's sources as bytes, split into train and validation by file.

    A file goes to validation when ``crc32(relative path) % 16 == 0``, a split that does not
    depend on the order or the number of files. Files are read in sorted order until both caps
    are reached (a file that would overflow its stream's cap is skipped).

    Args:
        max_train_bytes: Cap of the training stream.
        max_valid_bytes: Cap of the validation stream.
        root: Directory to read instead of the running interpreter's stdlib (tests).

    Returns:
        The corpus.

    Raises:
        RuntimeError: Too little text found for either split.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    chunks: dict[bool, list[bytes]] = {True: [], False: []}
    sizes = {True: 0, False: 0}
    caps = {True: max_valid_bytes, False: max_train_bytes}
    for path in stdlib_source_files(str(base)):
        is_valid = zlib.crc32(path.relative_to(base).as_posix().encode()) % _VALID_EVERY == 0
        if sizes[is_valid] >= caps[is_valid]:
            if sizes[not is_valid] >= caps[not is_valid]:
                break
            continue
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file (permissions): not part of the corpus
            continue
        if sizes[is_valid] + len(data) + 1 > caps[is_valid]:
            continue
        chunks[is_valid].append(data + b"\n")
        sizes[is_valid] += len(data) + 1
    if sizes[False] < 1 << 16 or sizes[True] < 1 << 12:
        raise RuntimeError(
            f"too little Python source under {base} (train {sizes[False]} B, validation "
            f"{sizes[True]} B); is the standard library installed?"
        )

    def stream(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)

    return ByteCorpus(
        train=stream(chunks[False]),
        valid=stream(chunks[True]),
        train_files=len(chunks[False]),
        valid_files=len(chunks[True]),
        root=str(base),
    )


# ------------------------------------------------------------------------------------------------
# Model.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """A tiny Qwen3-style MoE GPT (every layer MoE, GQA, QK-norm, RoPE, SwiGLU experts).

    Attributes:
        num_layers: Transformer layers, all MoE.
        hidden_size: Model width H.
        num_attention_heads: Query heads.
        num_query_groups: Key/value heads (GQA).
        kv_channels: Head dimension.
        num_experts: Routed experts E.
        topk: Experts per token.
        moe_ffn_hidden_size: Expert FFN width F (fc1 is 2F wide: SwiGLU).
        seq_length: Tokens per sample S.
        aux_loss_coeff: Load-balancing aux loss coefficient.
        rotary_base: RoPE base.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    num_experts: int = 8
    topk: int = 2
    moe_ffn_hidden_size: int = 64
    seq_length: int = 128
    aux_loss_coeff: float = 1e-2
    rotary_base: int = 10000


def qwen3_style_config(shape: ModelShape, expert_model_parallel_size: int) -> TransformerConfig:
    """A CPU-runnable fp32 ``TransformerConfig`` with Qwen3-MoE's architecture choices.

    RMSNorm (eps 1e-6), QK-layernorm, GQA, SwiGLU experts without biases, softmax router over
    the top-k logits (``moe_router_pre_softmax=False``: normalised top-k probabilities, HF's
    ``norm_topk_prob=True``), fp32 router, aux-loss load balancing, alltoall dispatcher, dropout
    0 (runs must be comparable step by step). Fused kernels and TE are off (local spec).
    """
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        ffn_hidden_size=4 * shape.hidden_size,  # unused: every layer is MoE
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=shape.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=expert_model_parallel_size,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        gradient_accumulation_fusion=False,
        transformer_impl="local",
        attention_backend=AttnBackend.local,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_gpt_model(
    config: TransformerConfig, shape: ModelShape, lrmoe: Optional[LRMoEConfig] = None
) -> torch.nn.Module:
    """``GPTModel`` from the local decoder block spec; its MoE layers are LRMoE when ``lrmoe``.

    Args:
        config: From :func:`qwen3_style_config`.
        shape: The same shape (vocabulary, sequence length, RoPE base).
        lrmoe: ``None`` for stock ``MoELayer`` + ``SequentialMLP``; else the LRMoE settings.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_lrmoe.specs import lrmoe_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if lrmoe is not None:
        spec = lrmoe_decoder_block_spec(spec, lrmoe)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=shape.seq_length,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=shape.rotary_base,
    )


# ------------------------------------------------------------------------------------------------
# MoE-layer time and backward bytes.
# ------------------------------------------------------------------------------------------------
class MoELayerProbe:
    """Time in every MoE layer (:class:`~megatron_lrmoe.observe.timing.MoELayerTimer`) and the
    bytes its backward exchanges send.

    Backward bytes are the bytes this rank sends in the layer's backward exchanges: an LRMoE
    layer reports them in ``last_call_stats.backward_bytes``; for a stock ``MoELayer`` they are
    derived from the alltoall dispatcher's splits (:func:`megatron_lrmoe.observe.metrics.
    stock_backward_bytes`), the same accounting as LRMoE's ``stock_backward_bytes``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron_lrmoe.observe.timing import MoELayerTimer

        self.timer = MoELayerTimer(model)
        self.layers = self.timer.layers
        self._bytes = 0
        self._pending_stats: list[Any] = []
        self._handles = [layer.register_forward_hook(self._forward_done) for layer in self.layers]

    def _forward_done(self, layer: Any, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        stats = getattr(layer, "last_call_stats", None)
        if stats is not None:
            self._pending_stats.append(stats)  # its bytes are known once backward ran
            return
        from megatron_lrmoe.observe.metrics import stock_backward_bytes

        dispatcher = layer.token_dispatcher
        hidden = args[0]
        self._bytes += stock_backward_bytes(
            dispatcher.input_splits,
            dispatcher.output_splits,
            hidden.shape[-1],
            hidden.element_size(),
        )

    def take(self) -> tuple[float, int]:
        """Seconds in MoE layers and backward bytes sent since the last call; resets both."""
        seconds = self.timer.take()  # NOTE: syncs on GPU
        sent = self._bytes + sum(s.backward_bytes for s in self._pending_stats)
        self._pending_stats, self._bytes = [], 0
        return seconds, sent

    def remove(self) -> None:
        """Remove the hooks."""
        self.timer.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------
# Checkpoints.
# ------------------------------------------------------------------------------------------------
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def _synchronous_write_queue() -> None:
    """Let the torch_dist writer run inside a daemonic process.

    megatron's ``FileSystemWriterAsync`` collects write results through a
    ``multiprocessing.Manager().Queue()``, which starts a server process; daemonic processes
    (``run_distributed``'s ranks) may not start children. A synchronous save produces and reads
    the results in the same process, so a thread queue does the same job. Elsewhere nothing
    changes (an async save from a normal process needs the Manager queue).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if multiprocessing.current_process().daemon and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    model: torch.nn.Module,
    directory: str,
    optimizer: Any = None,
    common: Optional[dict[str, Any]] = None,
) -> None:
    """Save a torch_dist checkpoint ``{"model": ..., ["optimizer": ...], **common}``.

    Every rank calls. The model part is the model's ``sharded_state_dict`` with Megatron's
    global keys (LRMoE experts under ``SequentialMLP``'s global keys and shapes), so stock and
    LRMoE models load each other's checkpoints. The optimizer part is Megatron's
    ``optimizer.sharded_state_dict(model_sharded_state_dict)``, which maps optimizer state to
    the model's sharded entries by parameter identity; LRMoE's entries hold its ``[L, ...]``
    expert parameters themselves, so the optimizer state of stock and LRMoE models moves
    between them too.

    Args:
        model: The model (DDP-wrapped or not).
        directory: Target directory (created).
        optimizer: A Megatron optimizer whose state to save too, or None.
        common: Plain values saved once (rank 0), e.g. the iteration.
    """
    from megatron.core import dist_checkpointing

    try:
        import psutil  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "psutil is not installed; megatron's torch_dist checkpoint writer needs it "
            "(pip install psutil)"
        ) from e
    state: dict[str, Any] = {"model": _unwrap(model).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state.update(common or {})
    _synchronous_write_queue()
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(state, directory)


def load_checkpoint(
    model: torch.nn.Module, directory: str, optimizer: Any = None
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` checkpoint as Megatron's training loop does.

    ``dist_checkpointing.load`` of the requested sharded state dicts, then strict
    ``load_state_dict`` calls. Every requested key must be in the checkpoint
    (``StrictHandling.RAISE_UNEXPECTED``); optimizer state in the checkpoint that is not asked
    for is ignored (a model-only resume).

    Args:
        model: The model to fill (DDP-wrapped or not).
        directory: A checkpoint directory.
        optimizer: A Megatron optimizer to restore too, or None (fresh optimizer state).

    Returns:
        The checkpoint's plain values (``common`` of the save).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    module = _unwrap(model)
    request: dict[str, Any] = {"model": module.sharded_state_dict()}
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(request["model"], is_loading=True)
    # The result holds the checkpoint's plain values (``common``) next to the loaded tensors.
    state = dist_checkpointing.load(request, directory, strict=StrictHandling.RAISE_UNEXPECTED)
    module.load_state_dict(state.pop("model"), strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state.pop("optimizer"))
    return {k: v for k, v in state.items() if k not in ("model", "optimizer")}


# ------------------------------------------------------------------------------------------------
# Training.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSettings:
    """Optimisation and bookkeeping of one run.

    Attributes:
        steps: Optimizer steps.
        micro_batch_size: Samples per micro-batch per data-parallel rank.
        num_microbatches: Micro-batches per step (gradient accumulation).
        lr: Peak learning rate (Adam); linear warm-up, then cosine decay to ``min_lr``.
        min_lr: Final learning rate.
        warmup_steps: Warm-up steps.
        weight_decay: Adam(W) weight decay.
        clip_grad: Gradient-norm clip (0 disables).
        seed: Seeds the initial weights and the training batches.
        eval_interval: Evaluate the validation loss every this many steps (and at the end).
        eval_batches: Validation micro-batches per rank per evaluation.
    """

    steps: int = 200
    micro_batch_size: int = 8
    num_microbatches: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    eval_interval: int = 20
    eval_batches: int = 2


@dataclass
class StepRecord:
    """What one step measured (times are this rank's wall clock, evaluation excluded)."""

    step: int
    loss: float
    train_seconds: float
    moe_seconds: float
    backward_bytes: int
    valid_loss: Optional[float] = None
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """One model, its Megatron DDP wrapper, optimizer, LR schedule and data stream.

    Args:
        shape: Model shape.
        settings: Optimisation settings.
        corpus: Data.
        lrmoe: ``None`` for stock Megatron MoE layers, else LRMoE settings.
        init_from: A stock model's ``state_dict()`` to start from (so stock and LRMoE runs start
            from the same weights: LRMoE experts draw their initial values in a different order
            than ``SequentialMLP``); ``None`` keeps the seeded initialisation.
        metrics: Collect LRMoE statistics through :class:`megatron_lrmoe.observe.metrics.LRMoEMetrics`.
        start_step: Resume at this step: the data stream and the LR schedule skip ahead to it
            (load the weights with :meth:`load` afterwards). The optimizer state starts fresh.
    """

    def __init__(
        self,
        shape: ModelShape,
        settings: TrainSettings,
        corpus: ByteCorpus,
        lrmoe: Optional[LRMoEConfig] = None,
        init_from: Optional[dict[str, torch.Tensor]] = None,
        metrics: bool = True,
        start_step: int = 0,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.shape, self.settings, self.corpus, self.lrmoe = shape, settings, corpus, lrmoe
        ep = parallel_state.get_expert_model_parallel_world_size()
        self.config = qwen3_style_config(shape, ep)
        # Same seeds before every build: runs of one process start from the same weights.
        torch.manual_seed(settings.seed)
        model_parallel_cuda_manual_seed(settings.seed)
        model = build_gpt_model(self.config, shape, lrmoe)
        if init_from is not None:
            model.load_state_dict(init_from, strict=True)
        self.initial_state = _detached_copy(model.state_dict())
        self.model = DistributedDataParallel(self.config, DistributedDataParallelConfig(), model)
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=settings.lr,
                min_lr=settings.min_lr,
                weight_decay=settings.weight_decay,
                clip_grad=settings.clip_grad,
                adam_beta2=0.95,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=settings.lr,
            min_lr=settings.min_lr,
            lr_warmup_steps=settings.warmup_steps,
            lr_decay_steps=max(settings.steps, settings.warmup_steps + 1),
            lr_decay_style="cosine",
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=settings.steps,
            wd_incr_style="constant",
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + self.dp_rank)
        self.valid = corpus.valid_batches(
            settings.eval_batches,
            settings.micro_batch_size,
            shape.seq_length,
            self.dp_rank,
            self.dp_size,
        )
        self.probe = MoELayerProbe(self.model)
        self.metrics = None
        if metrics and lrmoe is not None:
            from megatron_lrmoe.observe.metrics import LRMoEMetrics

            self.metrics = LRMoEMetrics(self.model, start_iteration=start_step)
        self.step = 0
        if start_step:
            for _ in range(start_step * settings.num_microbatches):
                self._next_batch()
            self.scheduler.step(increment=start_step)
            self.step = start_step
        positions = torch.arange(shape.seq_length).unsqueeze(0)
        self._positions = positions.expand(settings.micro_batch_size, -1)

    def _next_batch(self) -> torch.Tensor:
        return self.corpus.train_batch(
            self.generator, self.settings.micro_batch_size, self.shape.seq_length
        )

    def save(self, directory: str, optimizer: bool = False) -> None:
        """Checkpoint the model (and the optimizer state) at this step; every rank calls.

        See :func:`save_checkpoint`.
        """
        common = {"iteration": self.step}
        save_checkpoint(self.model, directory, self.optimizer if optimizer else None, common)

    def load(self, directory: str, optimizer: bool = False) -> None:
        """Load the model (and the optimizer state) of :meth:`save`; every rank calls.

        The trainer must have been built with ``start_step`` equal to the checkpoint's
        iteration: the data stream and LR schedule are functions of the step. Without
        ``optimizer`` the optimizer state stays fresh (Adam's moments restart).

        Raises:
            ValueError: The checkpoint was saved at another step.
        """
        common = load_checkpoint(self.model, directory, self.optimizer if optimizer else None)
        if common.get("iteration") != self.step:
            raise ValueError(
                f"checkpoint {directory} is at iteration {common.get('iteration')}, this trainer "
                f"at step {self.step}; build the Trainer with start_step={common.get('iteration')}"
            )

    # --- one step -------------------------------------------------------------------------------
    def _forward_step(self, data: Iterator[torch.Tensor], model: torch.nn.Module):
        window = next(data)
        tokens, labels = window[:, :-1], window[:, 1:]
        per_token = model(tokens, self._positions, None, labels=labels)  # [B, S]
        return per_token, _mean_loss

    def train_step(self) -> StepRecord:
        """One optimizer step over ``num_microbatches`` fresh micro-batches of every rank."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        s = self.settings
        batches = [self._next_batch() for _ in range(s.num_microbatches)]
        self.model.train()
        # Sampling keyed by the step: a resumed run draws what the uninterrupted run draws.
        set_lrmoe_training_step(self.model, self.step)
        start = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(batches),
            model=[self.model],
            num_microbatches=s.num_microbatches,
            seq_length=self.shape.seq_length,
            micro_batch_size=s.micro_batch_size,
            forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {self.step + 1} failed (non-finite gradients)")
        self.scheduler.step(increment=1)
        train_seconds = time.perf_counter() - start
        self.step += 1
        moe_seconds, sent = self.probe.take()
        # As megatron.training's training_log does every iteration: report (and so clear) the
        # router's aux loss. LRMoE's metrics keep their own accumulator and survive this.
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / s.num_microbatches,
            iteration=self.step,
            track_names=["load_balancing_loss"],
            num_layers=self.config.num_layers,
            force_initialize=True,
        )
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        torch.distributed.all_reduce(loss, group=self.dp_group)
        return StepRecord(
            step=self.step,
            loss=float(loss) / self.dp_size,
            train_seconds=train_seconds,
            moe_seconds=moe_seconds,
            backward_bytes=sent,
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation windows of every data-parallel rank."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for window in self.valid:
            per_token = self.model(window[:, :-1], self._positions, None, labels=window[:, 1:])
            total[0] += per_token.double().sum()
            total[1] += per_token.numel()
        self.model.train()
        torch.distributed.all_reduce(total, group=self.dp_group)
        return float(total[0] / total[1])

    def run(
        self, on_step: Optional[Callable[[StepRecord], None]] = None, steps: Optional[int] = None
    ) -> list[StepRecord]:
        """Train ``steps`` (default: the rest of ``settings.steps``); evaluate on schedule.

        Args:
            on_step: Called with every step's record (after evaluation and metrics, if due).
            steps: Number of steps to run now.

        Returns:
            The records of the steps run.
        """
        s = self.settings
        todo = s.steps - self.step if steps is None else steps
        records = []
        for _ in range(todo):
            record = self.train_step()
            if record.step % s.eval_interval == 0 or record.step == s.steps:
                record.valid_loss = self.evaluate()
                if self.metrics is not None:
                    record.metrics = self.metrics.report(record.step)
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def close(self) -> None:
        """Remove hooks (the model stays usable)."""
        self.probe.remove()
        if self.metrics is not None:
            self.metrics.close()


def _detached_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state dict whose tensors do not alias the live parameters."""
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _mean_loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach()}
