"""Moving rows: Megatron's dispatcher stages, token <-> pair permutation, index plans, exchanges.

``route.py`` moves one call's rows (exchanges, reorders, send order) behind its frozen plan;
``comm.py`` is the package's only caller of ``torch.distributed`` collectives on the hot path.
"""
