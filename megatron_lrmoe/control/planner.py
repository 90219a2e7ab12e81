"""Compatibility names: the integer planning functions now live in one module per job.

* quotas and their split over sources: :mod:`megatron_lrmoe.control.quota`
* min-max assignment over replicas: :mod:`megatron_lrmoe.control.balance`
* replica placement: :mod:`megatron_lrmoe.control.placement`
* the per-call controller: :mod:`megatron_lrmoe.control.controller`
"""

from __future__ import annotations

from megatron_lrmoe.control.balance import (
    balance_over_replicas,
    greedy_balance_over_replicas,
    min_max_balance,
)
from megatron_lrmoe.control.quota import expert_quotas, split_quota_over_sources

__all__ = [
    "balance_over_replicas",
    "expert_quotas",
    "greedy_balance_over_replicas",
    "min_max_balance",
    "split_quota_over_sources",
]
