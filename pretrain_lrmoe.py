"""Pretrain a GPT model with megatron.training, stock or with LRMoE MoE layers (``--lrmoe``).

A thin counterpart of Megatron-LM's ``pretrain_gpt.py`` (which the megatron-core wheel does not
ship) for megatron-core 0.19 with its bundled ``megatron.training``: same arguments, same
config-container call of ``megatron.training.pretrain``, same batch and loss handling, plus the
``--lrmoe`` / ``--lrmoe-*`` flags (``python pretrain_lrmoe.py --lrmoe-help`` lists them alone, at
once; ``--help`` lists them after Megatron's ~3,900 lines, group "LRMoE"). Without
``--lrmoe`` the model is built by Megatron's own ``GPTModelBuilder`` and the run is a stock
run; with it every MoE layer, Multi-Token-Prediction layers included, is an ``LRMoELayer``.

Run it like ``pretrain_gpt.py``::

    torchrun --nproc_per_node 2 pretrain_lrmoe.py <Megatron GPT/MoE flags> [--lrmoe ...]
    # or, installed: torchrun --nproc_per_node 2 $(which lrmoe-pretrain) ...

See ``examples/`` for complete launch scripts (Qwen3-30B-A3B, GLM-4.5-Air, and 2-GPU proxies).

Scope: GPT pretraining on ``megatron.core.datasets`` (``GPTDataset`` over indexed datasets given
by ``--data-path`` / ``--train-data-path`` ..., or ``MockGPTDataset`` with ``--mock-data``).
SFT, FIM, packed sequences (``--dataloader-inter-document-masking``), hybrid context
parallelism, ModelOpt and logit distillation are left to Megatron-LM's ``pretrain_gpt.py``
(``patches/`` adds the LRMoE flags to it).

Data. Megatron's ``tools/preprocess_data.py`` is not in the wheel. ``examples/
make_indexed_dataset.py`` writes an indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) from
text files with a byte-level tokenizer that needs no download: token = UTF-8 byte (0-255),
one end-of-document token 256 after each file. Train on it with
``--tokenizer-type NullTokenizer --null-tokenizer-eod-id 256 --vocab-size V`` (any ``V >= 257``;
the examples keep the real model's vocabulary size so the output layer has its real shape)::

    python examples/make_indexed_dataset.py --output-prefix .data/pystdlib_bytes \\
        --max-bytes 12000000            # the Python standard library's sources, ~12 MB
    ... --data-path .data/pystdlib_bytes --split 98,2,0 --data-cache-path /tmp/lrmoe_cache

Megatron-specific trap handled here: ``megatron.training`` runs ``make`` to compile its dataset
helper, which fails with the wheel although the wheel ships the compiled helper
(``megatron_lrmoe.training.compat.use_prebuilt_dataset_helpers``).

Statistics. With ``--lrmoe`` the LRMoE statistics (``megatron_lrmoe.observe.metrics.LRMoEMetrics``:
kept ratio, dropped score fraction, backward bytes and bytes saved, overhead, added variance) are
reduced over all ranks at every ``--log-interval`` (and the first iteration), written as
``lrmoe/...`` scalars to Megatron's TensorBoard and W&B writers (per layer with
``--moe-per-layer-logging``) and printed in a line right after Megatron's iteration line::

     [...] iteration      100/   10000 | consumed samples: ... | lm loss: ... | ...
     [...] iteration      100/   10000 | lrmoe kept: 0.500 | lrmoe dropped score: 0.213 | ...

``megatron.training.training_log`` has no hook for this; ``megatron_lrmoe.training.
training_hooks`` explains the explicit, version-checked wrappers ``main`` installs. Without
``--lrmoe`` nothing is installed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from typing import Any, Iterator, Optional

from megatron_lrmoe.training.args import LRMOE_HELP_FLAG, lrmoe_help_text

if __name__ == "__main__" and LRMOE_HELP_FLAG in sys.argv[1:]:
    # Answer before the torch / megatron imports below, which take seconds; the console script
    # (lrmoe-pretrain) gets the same text from the flag's argparse action in main().
    sys.stdout.write(lrmoe_help_text())
    sys.exit(0)

# Imports after the early exit above, on purpose.
import torch  # noqa: E402
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks, mtp_on_this_rank
from megatron.core.utils import (
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, get_tokenizer, inprocess_restart, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import (
    core_transformer_config_from_args,
    parse_and_validate_args,
    parse_args,
)
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from megatron_lrmoe.training import compat, memory_cap
from megatron_lrmoe.training.args import add_lrmoe_args, validate_lrmoe_args
from megatron_lrmoe.training.model import gpt_model_config_from_args
from megatron_lrmoe.training.hooks import install_lrmoe_training_log
from megatron_lrmoe.training.validation_spread import ValidationSpread

logger = logging.getLogger(__name__)

# The batch fields a GPT pretraining step uses, as GPTDataset / MockGPTDataset produce them.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

# A loss this many times the largest seen so far counts as a spike (with --check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10

# Flags whose data paths this entry point does not implement (Megatron-LM's pretrain_gpt.py does).
_UNSUPPORTED_DATA_FLAGS = {
    "sft": "--sft",
    "fim_data": "--fim-data",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "logits_load_dir": "--logits-load-dir",
}


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: the LRMoE flags, and a ``--help`` that works."""
    return add_lrmoe_args(compat.repair_help_strings(parser))


def check_args(args: argparse.Namespace) -> None:
    """Checks beyond Megatron's ``validate_args``; ``ValueError`` names the flags and the fix."""
    validate_lrmoe_args(args)
    compat.check_transformer_impl(args)
    for name, flag in _UNSUPPORTED_DATA_FLAGS.items():
        if getattr(args, name, None):
            raise ValueError(
                f"{flag} is not supported by pretrain_lrmoe.py (GPT pretraining only); use "
                "Megatron-LM's pretrain_gpt.py with patches/megatron-lm-core_r0.19.0-lrmoe.patch"
            )


def get_batch(
    data_iterator: Optional[Iterator[dict[str, torch.Tensor]]],
    config: Any,
    vp_stage: Optional[int] = None,
) -> dict[str, Optional[torch.Tensor]]:
    """Next micro-batch on this rank: read on tensor-parallel rank 0, broadcast, CP-sliced.

    Args:
        data_iterator: The data iterator (None on ranks that do not read data).
        config: The model's ``TransformerConfig`` (pipeline layout and MTP layers).
        vp_stage: Virtual pipeline stage of the model chunk.

    Returns:
        ``BATCH_KEYS`` -> tensor on the current device, None where this stage needs none.
    """
    args = get_args()
    mtp_here = mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return dict.fromkeys(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {
            key: sample[key].cuda(non_blocking=True) if sample.get(key) is not None else None
            for key in BATCH_KEYS
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return {key: batch.get(key) for key in BATCH_KEYS}


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked token loss of one micro-batch, in megatron.training's per-token form.

    Args:
        loss_mask: ``[b, s]`` 1 for tokens that count.
        output_tensor: ``[b, s]`` per-token losses from ``GPTModel`` (MTP losses are added to
            the gradient inside the model, as in stock Megatron).

    Returns:
        The summed loss, the number of counted tokens, and ``{"lm loss": [sum, tokens]}`` for
        the data-parallel-averaged report.
    """
    args = get_args()
    if not torch.is_grad_enabled():  # an evaluation micro-batch: its per-sequence losses
        spread = _validation_spread(args)
        if spread is not None:
            spread.record(output_tensor.view(loss_mask.shape), loss_mask)
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        # The forward is deterministic, hence tolerance 0: a rerun must reproduce the value.
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large,
                threshold=SPIKY_LOSS_FACTOR,
                context="loss",
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    return loss, num_tokens, report


_VALIDATION_SPREAD: Optional[ValidationSpread] = None


def _validation_spread(args: argparse.Namespace) -> Optional[ValidationSpread]:
    """The process's :class:`ValidationSpread` (None with context parallelism, where a rank
    sees only part of each sequence)."""
    global _VALIDATION_SPREAD
    if args.context_parallel_size > 1:
        return None
    if _VALIDATION_SPREAD is None:
        from megatron.training.utils import print_rank_last

        group = mpu.get_data_parallel_group()

        def micro_batches() -> int:
            per_step = args.eval_micro_batch_size * args.data_parallel_size
            return int(args.eval_iters) * max(1, args.eval_global_batch_size // per_step)

        _VALIDATION_SPREAD = ValidationSpread(
            micro_batches,
            print_rank_last,
            lambda t: torch.distributed.all_reduce(t, group=group),
        )
    return _VALIDATION_SPREAD


def forward_step(data_iterator: Any, model: GPTModel, return_schedule_plan: bool = False):
    """One forward step: batch, model call, and the loss function to apply to its output.

    Args:
        data_iterator: The data iterator of this model chunk.
        model: The (wrapped) GPT model chunk.
        return_schedule_plan: Return ``model.build_schedule_plan`` (stock EP-overlap schedule,
            ``--overlap-moe-expert-parallel-comm``) instead of running the model.
    """
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    config = get_attr_wrapped_model(model, "config")
    batch = get_batch(data_iterator, config, vp_stage)
    timers("batch-generator").stop()
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:
        if not get_args().overlap_moe_expert_parallel_comm:
            raise ValueError("a schedule plan needs --overlap-moe-expert-parallel-comm")
        plan = model.build_schedule_plan(
            *inputs, labels=batch["labels"], loss_mask=batch["loss_mask"]
        )
        return plan, partial(loss_func, batch["loss_mask"])
    output_tensor = model(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Datasets are read on tensor-parallel rank 0 of stages that hold embeddings, loss or MTP."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    if is_first_or_last_pipeline_stage(vp_stage):
        return True
    config = core_transformer_config_from_args(get_args())
    return mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def gpt_dataset_config_from_args(args: argparse.Namespace, tokenizer: Any) -> GPTDatasetConfig:
    """``GPTDatasetConfig`` from Megatron's data flags (``--data-path``, ``--split``, ...).

    With ``--mock-data`` the data paths are ignored (the config is a mock one only without
    them).
    """
    blend, blend_per_split = None, None
    if not args.mock_data:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def build_gpt_datasets(
    args: argparse.Namespace,
    tokenizer: Any,
    train_val_test_num_samples: list[int],
    vp_stage: Optional[int] = None,
) -> tuple[Any, Any, Any]:
    """Train, validation and test datasets: ``MockGPTDataset`` with ``--mock-data``, else
    ``GPTDataset`` over the indexed datasets named by the data flags."""
    config = gpt_dataset_config_from_args(args, tokenizer)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    logger.info("building %s train/validation/test datasets", dataset_type.__name__)
    return BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: Optional[int] = None
) -> tuple[Any, Any, Any]:
    """megatron.training's dataset provider (``vp_stage`` for virtual pipelines)."""
    return build_gpt_datasets(get_args(), get_tokenizer(), train_val_test_num_samples, vp_stage)


# megatron.training calls a provider marked distributed on every rank (core datasets decide
# per rank through is_dataset_built_on_rank) instead of only on tensor-parallel rank 0.
train_valid_test_datasets_provider.is_distributed = True


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding word embeddings: first stage, last stage when tied, and MTP stages."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


# Set on the handler log_to_stderr adds, so that a second call adds none.
_STDERR_HANDLER_MARK = "__lrmoe_stderr__"


def log_to_stderr() -> None:
    """Send this entry point's and megatron_lrmoe's log records (INFO and up) to stderr.

    Importing ``megatron.training`` configures the root logger to print INFO records on stdout,
    where ours would land in the middle of ``--help`` text and the iteration lines. Idempotent.
    """
    for name in ("megatron_lrmoe", logger.name):
        package_logger = logging.getLogger(name)
        if any(getattr(h, _STDERR_HANDLER_MARK, False) for h in package_logger.handlers):
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        setattr(handler, _STDERR_HANDLER_MARK, True)
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
        package_logger.propagate = False


def main() -> None:
    """Console entry point ``lrmoe-pretrain`` (also ``python pretrain_lrmoe.py``)."""
    log_to_stderr()
    compat.check_megatron_core_version()
    # The LRMoE flags and their combinations with Megatron's, on the command line as given,
    # before Megatron's validate_args prints its ~860-line argument dump; checked again below on
    # the validated arguments (a checkpoint's or a YAML file's settings merged in).
    try:
        check_args(parse_args(extra_args_provider))
    except ValueError as e:
        raise SystemExit(f"pretrain_lrmoe.py: error: {e}") from e
    args = parse_and_validate_args(
        extra_args_provider=extra_args_provider,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    # After parsing, so that --help / --lrmoe-help / a bad flag answer without it; before
    # pretrain(), whose initialisation would run `make`.
    compat.use_prebuilt_dataset_helpers()
    try:
        compat.fix_full_validation(args)
        check_args(args)
        # Before Megatron's initialisation allocates anything on the GPU.
        if args.memory_cap_gib is not None and args.gpu_memory_gib is not None:
            raise ValueError(
                f"--memory-cap-gib ({args.memory_cap_gib}) and --gpu-memory-gib "
                f"({args.gpu_memory_gib}) both limit the GPU's memory; give one"
            )
        memory_cap.apply_memory_cap(args.memory_cap_gib)
        memory_cap.apply_gpu_memory(args.gpu_memory_gib)
    except ValueError as e:
        raise SystemExit(f"pretrain_lrmoe.py: error: {e}") from e
    # --lrmoe only: LRMoE statistics at --log-interval, in a line after Megatron's iteration line
    # and as lrmoe/... TensorBoard / W&B scalars (megatron_lrmoe.training.hooks).
    install_lrmoe_training_log(args)
    # After our parse: it re-parses sys.argv without our flags and would mishandle --help.
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    model_config = gpt_model_config_from_args(args)
    run_pretrain(
        pretrain_cfg_container_from_args(args, model_config),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
