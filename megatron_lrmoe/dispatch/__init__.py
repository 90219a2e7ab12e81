"""Moving rows: Megatron's dispatcher stages, token <-> pair permutation, index plans, exchanges.

``comm.py`` is the package's only caller of ``torch.distributed`` collectives on the hot path.
"""
