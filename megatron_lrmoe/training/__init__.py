"""Megatron training integration: ``--lrmoe-*`` flags, the GPT model builder, training hooks."""
