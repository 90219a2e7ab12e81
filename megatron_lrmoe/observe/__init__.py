"""Per-call statistics of LRMoE layers and their Megatron metrics."""
