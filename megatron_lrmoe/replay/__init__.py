"""Routing replay: recorded (or synthetic) MoE routing at P virtual EP ranks, priced per rank.

``python -m megatron_lrmoe.replay --help``; docs/replay.md describes the model. Modules:
``cost`` (GEMM table, all-to-all pricing, the layer costs: router, elementwise work,
``main_grad``, host), ``shard`` (recorded counts onto P ranks, synthetic
counts), ``replay`` (arms, one call planned by the controller and priced), ``cli``.
Nothing is imported here beyond the docstring: ``from megatron_lrmoe.replay.replay import ...``.
"""
