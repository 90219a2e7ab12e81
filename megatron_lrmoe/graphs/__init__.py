"""The backward's CUDA graphs: work of the stages below, captured once and replayed.

A floor of its own, above ``select/`` and ``experts/`` (whose launches it records) and below
``op/`` (which replays it); the stages never import it. Each module captures one thing:

* ``front.py``: the front (scoring, selection and, behind them, the router gradient's row-dot
  and the packing of the kept rows) as one graph per shape;
* ``backward.py``: at EP 1 the front and the expert backward together, one graph per layer.

The selection alone keeps its graph beside its kernels (``select/select_triton.py``, called by
``scoring.select``); ``front.py`` extends it. Capturing and the least-recently-used cache of
graphs are ground floor (``cuda_graphs.py``).

Nothing is imported here: import the module you need (``from megatron_lrmoe.graphs import
front``).
"""
