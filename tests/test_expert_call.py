"""``ExpertCall`` is frozen; the layer completes it once behind the forward.

The op's own numerics are tested through the layer (``test_layer.py``, ``test_op.py``); this file
checks the contract of the per-call context: a call is planned before its forward or runs ahead of
the plan on device rows (never both, never neither), the plan and statistics arrive exactly once,
and the backward's grouping follows the plan's host counts once it is there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.route import RowRoute
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.observe.stats import CallStats
from megatron_lrmoe.op import ExpertCall


_SPEC = GluSpec(gated=True, kind="silu")


def _parts(keep: float = 0.5) -> tuple[CallPlan, RowRoute, LRMoEConfig]:
    """One rank, 4 experts, 6 tokens routed top-2: its plan and route."""
    lrmoe = LRMoEConfig(keep_ratio=keep)
    routing = torch.zeros(6, 4, dtype=torch.bool)
    for t in range(6):
        routing[t, t % 4] = routing[t, (t + 1) % 4] = True
    perm = PairPermutation.build(routing, num_pairs=12, topk=2)
    counts = routing.sum(0).unsqueeze(0).to(torch.int64)
    plan = CallPlan.build(counts, 0, 4, lrmoe, layer_number=3, stream=())
    return plan, RowRoute.build(perm, plan, None, None), lrmoe


def _stats(plan: CallPlan) -> CallStats:
    return CallStats(layer_number=3, call_index=0, total_pairs=12, pairs_sent=12,
                     quota_per_expert=plan.quota.tolist(), tokens_per_expert=[3, 4, 3, 2])


def test_a_planned_call_takes_its_statistics_once() -> None:
    plan, route, lrmoe = _parts()
    call = ExpertCall(plan, lrmoe, _SPEC, route)
    assert call.plan is plan and call.stats is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.planned = None  # type: ignore[misc]
    with pytest.raises(ValueError, match="exactly when the forward ran ahead"):
        call.complete(None, plan)  # it has a plan already
    stats = _stats(plan)
    call.complete(stats)
    assert call.stats is stats and call.plan is plan
    with pytest.raises(RuntimeError, match="called twice"):
        call.complete(stats)


def test_a_call_ahead_of_its_plan_groups_by_device_rows_then_by_the_plan() -> None:
    plan, _, lrmoe = _parts()
    route = RowRoute.build(_parts()[1].perm, None, None, None)  # one rank: no plan needed
    # Device rows other than the plan's counts, to tell which grouping each side reads.
    device_rows = torch.tensor([9, 9, 9, 9])
    call = ExpertCall(None, lrmoe, _SPEC, route, device_rows=device_rows)
    assert call.forward_groups.sizes == [9, 9, 9, 9]
    with pytest.raises(RuntimeError, match="before the layer completed"):
        call.plan
    with pytest.raises(ValueError, match="exactly when the forward ran ahead"):
        call.complete(None)
    call.complete(None, plan)
    assert call.plan is plan
    # The backward's groups come from the plan's host counts, not the device rows.
    assert call.groups.sizes == plan.tokens_per_local_expert.tolist() == [3, 4, 3, 2]
    assert call.forward_groups.sizes == [9, 9, 9, 9]


@pytest.mark.parametrize("device_rows", [None, torch.tensor([3, 4, 3, 2])])
def test_a_call_is_planned_or_runs_on_device_rows(device_rows) -> None:
    plan, route, lrmoe = _parts()
    given = plan if device_rows is not None else None  # both, or neither
    with pytest.raises(ValueError, match="not both|not neither"):
        ExpertCall(given, lrmoe, _SPEC, route, device_rows=device_rows)
