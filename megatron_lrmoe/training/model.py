"""GPT model configuration and builder for the training entry point: stock or LRMoE MoE layers.

``megatron.training`` 0.19 builds GPT models from a ``GPTModelConfig`` through the builder class
the config names (``GPTModelConfig.builder``). :func:`gpt_model_config_from_args` returns

* the stock ``GPTModelConfig`` (stock ``GPTModelBuilder``) when ``--lrmoe`` is absent, so such a
  run is stock Megatron, code path included;
* an :class:`LRMoEGPTModelConfig` when ``--lrmoe`` is given. Its :class:`LRMoEGPTModelBuilder`
  builds the same ``GPTModel`` (same spec, vocabulary padding and constructor arguments as
  ``GPTModelBuilder.build_model``) with every MoE layer made an ``LRMoELayer``: decoder layers
  through :func:`gpt_decoder_spec`, Multi-Token-Prediction layers through
  :func:`gpt_mtp_block_spec`.

Why a builder and not ``--spec``: ``GPTModelBuilder.build_model`` derives the MTP block spec from
Megatron's own decoder layer specs, not from ``transformer_layer_spec``, so with ``--spec`` alone
an MTP layer (GLM-4.5 has one) would keep the stock ``MoELayer``. Overriding ``build_model`` is
the hook that needs no core patch (ModelOpt's builder does the same).

Local and Transformer Engine variants follow ``--transformer-impl``: the decoder spec is
Megatron's (``get_gpt_decoder_block_spec(use_transformer_engine=...)``) and only its MoE
``mlp`` builders are replaced; shared experts and routers keep the backend's modules.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.models.gpt import (
    GPTModelBuilder,
    GPTModelConfig,
    default_layer_spec,
    mtp_block_spec,
)
from megatron.training.vocab_utils import calculate_padded_vocab_size

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.training.args import lrmoe_config_from_args
from megatron_lrmoe.specs import lrmoe_decoder_block_spec, lrmoe_layer_spec

logger = logging.getLogger(__name__)

__all__ = [
    "LRMoEGPTModelBuilder",
    "LRMoEGPTModelConfig",
    "gpt_decoder_spec",
    "gpt_model_config_from_args",
    "gpt_mtp_block_spec",
]


@dataclass(kw_only=True)
class LRMoEGPTModelConfig(GPTModelConfig):
    """``GPTModelConfig`` whose MoE layers (decoder and MTP) are built as LRMoE layers.

    Attributes:
        lrmoe: The LRMoE settings; ``None`` builds stock MoE layers (the config then behaves
            exactly like ``GPTModelConfig``).
    """

    builder: ClassVar[str] = "megatron_lrmoe.training.model.LRMoEGPTModelBuilder"
    lrmoe: Optional[LRMoEConfig] = None


def _lrmoe_of(model_config: GPTModelConfig) -> Optional[LRMoEConfig]:
    # A stock GPTModelConfig raises AttributeError for unknown names: None.
    return getattr(model_config, "lrmoe", None)


def gpt_decoder_spec(model_config: GPTModelConfig, vp_stage: Optional[int] = None) -> Any:
    """The decoder spec a model config builds: Megatron's, with MoE layers made LRMoE if asked.

    The base spec is resolved as ``GPTModelBuilder.build_model`` resolves it:
    ``transformer_layer_spec`` (a ``ModuleSpec``, or a callable taking the config and maybe
    ``vp_stage``, e.g. from ``--spec``), else ``default_layer_spec``.

    Args:
        model_config: A ``GPTModelConfig``; an :class:`LRMoEGPTModelConfig` with ``lrmoe`` set
            turns its MoE layers into LRMoE layers.
        vp_stage: Virtual pipeline stage.

    Returns:
        A ``TransformerBlockSubmodules`` (MoE models) or a layer ``ModuleSpec``.
    """
    spec = model_config.transformer_layer_spec
    if spec is None:
        spec = default_layer_spec(model_config, vp_stage)
    elif not isinstance(spec, ModuleSpec) and callable(spec):
        if "vp_stage" in inspect.signature(spec).parameters:
            spec = spec(model_config, vp_stage=vp_stage)
        else:
            spec = spec(model_config)
    lrmoe = _lrmoe_of(model_config)
    return spec if lrmoe is None else lrmoe_decoder_block_spec(spec, lrmoe)


def gpt_mtp_block_spec(
    model_config: GPTModelConfig, decoder_spec: Any, vp_stage: Optional[int] = None
) -> Any:
    """The Multi-Token-Prediction block spec, with its MoE layers made LRMoE if asked.

    Megatron's ``mtp_block_spec`` builds it from its own decoder layer specs (the last layer's),
    not from ``decoder_spec``; the MoE ``mlp`` of each MTP layer's inner transformer layer is
    then replaced like the decoder's.

    Args:
        model_config: As for :func:`gpt_decoder_spec`.
        decoder_spec: The decoder spec (Megatron inspects it for an empty pipeline stage).
        vp_stage: Virtual pipeline stage.

    Returns:
        A ``MultiTokenPredictionBlockSubmodules``, or None without MTP layers on this stage.
    """
    block = mtp_block_spec(model_config, decoder_spec, vp_stage=vp_stage)
    lrmoe = _lrmoe_of(model_config)
    if block is None or lrmoe is None:
        return block
    new_block = copy.copy(block)
    new_block.layer_specs = [_mtp_layer_as_lrmoe(s, lrmoe) for s in block.layer_specs]
    return new_block


def _mtp_layer_as_lrmoe(mtp_layer_spec: ModuleSpec, lrmoe: LRMoEConfig) -> ModuleSpec:
    new = copy.copy(mtp_layer_spec)
    new.submodules = copy.copy(mtp_layer_spec.submodules)
    new.submodules.mtp_model_layer = lrmoe_layer_spec(
        mtp_layer_spec.submodules.mtp_model_layer, lrmoe
    )
    return new


class LRMoEGPTModelBuilder(GPTModelBuilder):
    """``GPTModelBuilder`` that builds MoE layers, MTP layers included, as LRMoE layers.

    Only ``build_model`` differs: it takes the decoder and MTP specs from
    :func:`gpt_decoder_spec` and :func:`gpt_mtp_block_spec`; everything else (vocabulary
    padding, the local-attention override, pipeline flags, ``GPTModel`` arguments) is what
    ``GPTModelBuilder.build_model`` does in megatron-core 0.19, so at keep ratio 1.0 the model
    differs from stock only in its MoE layer class.
    """

    def build_model(
        self,
        pg_collection: ProcessGroupCollection,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
        vp_stage: Optional[int] = None,
    ) -> GPTModel:
        """Build one GPT model stage (see ``GPTModelBuilder.build_model``)."""
        cfg = self._model_config
        if _lrmoe_of(cfg) is None:
            return super().build_model(pg_collection, pre_process, post_process, vp_stage)
        decoder_spec = gpt_decoder_spec(cfg, vp_stage)
        if cfg.vocab_size is None:
            raise ValueError("GPTModelConfig.vocab_size must be set before building the model")
        vocab_size = cfg.vocab_size
        if cfg.should_pad_vocab:
            vocab_size = calculate_padded_vocab_size(
                cfg.vocab_size, cfg.make_vocab_size_divisible_by, cfg.tensor_model_parallel_size
            )
        mtp_spec = gpt_mtp_block_spec(cfg, decoder_spec, vp_stage)
        # Same override as GPTModelBuilder: a single layer spec gets the local core attention.
        if cfg.attention_backend == AttnBackend.local and isinstance(decoder_spec, ModuleSpec):
            decoder_spec.submodules.self_attention.submodules.core_attention = DotProductAttention
        vp_size = cfg.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and (
                is_pp_first_stage(pg_collection.pp)
            )
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and (
                is_pp_last_stage(pg_collection.pp)
            )
        return GPTModel(
            config=cfg.transformer,
            transformer_layer_spec=decoder_spec,
            mtp_block_spec=mtp_spec,
            vocab_size=vocab_size,
            max_sequence_length=cfg.seq_length,
            fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
            parallel_output=cfg.parallel_output,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rotary_base,
            rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )


def gpt_model_config_from_args(args: argparse.Namespace) -> GPTModelConfig:
    """The model config for parsed Megatron arguments: stock without ``--lrmoe``.

    Args:
        args: Arguments after ``parse_and_validate_args`` (with :func:`add_lrmoe_args`).

    Returns:
        ``gpt_config_from_args(args)`` without ``--lrmoe``; otherwise the same fields in an
        :class:`LRMoEGPTModelConfig` carrying ``lrmoe_config_from_args(args)``.
    """
    lrmoe = lrmoe_config_from_args(args)
    if lrmoe is None:
        return gpt_config_from_args(args)
    model_config = gpt_config_from_args(args, model_config_cls=LRMoEGPTModelConfig)
    model_config.lrmoe = lrmoe
    logger.info("LRMoE enabled for every MoE layer (decoder and MTP): %s", lrmoe)
    return model_config
