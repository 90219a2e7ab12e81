"""The controller wired into the layer (budgets, ``activation_mode="auto"``), CPU, gloo, EP=2.

Every case is checked against the dense masked reference with the same selection (the op is
exact for whatever quotas the controller set), and against what the controller promised: kept
pairs per expert equal its quotas, quotas never exceed ``ceil(keep_ratio * N)``, a budget that
does not bind changes nothing, a binding one trims and is named, an unmeetable one keeps no pair
without failing the call.
"""

from __future__ import annotations

import math

import pytest

import lrmoe_workers as w
from test_layer import _assert_matches_reference, _check_counts
from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config, run_distributed


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_distributed(w.controller_cases, 2, 2, timeout=300)


def test_controller_plans_are_computed_exactly(results: list[list[dict]]) -> None:
    _assert_matches_reference(results)
    _check_counts(results)


def test_controller_decisions(results: list[list[dict]]) -> None:
    loose, binding, auto, unmet = results[0]
    for d in results[0]:
        keep = d["case"][0]["keep_ratio"]
        ceil = [math.ceil(keep * n) for n in d["tokens_per_expert"]]
        assert all(q <= c for q, c in zip(d["quota"], ceil)), d["case"]
        assert d["control"] is not None, d["case"]
    # A budget ten times stock's exchange never binds: the plain quotas.
    assert loose["quota"] == [math.ceil(0.5 * n) for n in loose["tokens_per_expert"]]
    assert loose["control"]["binding_budgets"] == ""
    # Keep ratio 1 with a third of stock's exchange: trimmed (hottest first), named, backward
    # sends fewer rows than stock.
    assert "exchange" in binding["control"]["binding_budgets"]
    assert sum(binding["quota"]) < sum(binding["tokens_per_expert"])
    assert binding["control"]["trimmed_pairs"] == sum(binding["tokens_per_expert"]) - sum(
        binding["quota"]
    )
    assert binding["kept"] < binding["pairs"]
    assert auto["control"]["activation_mode"] in ("save", "recompute")
    # Nothing fits a one-byte memory budget: quota 0 everywhere, the call runs, it is counted.
    assert "memory" in unmet["control"]["unmet_budgets"]
    assert sum(unmet["quota"]) == 0 and unmet["kept"] == 0


def _build_with_replicas(rank: int, world: int) -> str:
    from megatron_lrmoe import get_lrmoe_moe_spec

    pg = init_megatron_parallel(ep=1)
    cfg = moe_transformer_config(expert_model_parallel_size=1)
    get_lrmoe_moe_spec(LRMoEConfig(max_replicas_per_rank=2))(
        config=cfg, pg_collection=pg, layer_number=2
    )
    try:
        get_lrmoe_moe_spec(LRMoEConfig(max_replicas_per_rank=2, scope="global"))(
            config=cfg, pg_collection=pg, layer_number=3
        )
    except ValueError as e:
        return str(e)
    return ""


def test_replicas_with_scope_global_are_refused() -> None:
    """Replicas are built (tests/test_replicas.py); with scope global they are refused."""
    (message,) = run_distributed(_build_with_replicas, 1, timeout=240)
    assert "max_replicas_per_rank=2" in message and "layer_number=3" in message
    assert "scope='global'" in message and "--lrmoe-scope local" in message
