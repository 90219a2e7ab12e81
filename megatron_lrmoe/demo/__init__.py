"""The CPU main job (``lrmoe-demo``): stock Megatron MoE vs LRMoE on 2 gloo ranks."""
