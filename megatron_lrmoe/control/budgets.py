"""The budget search: the largest quotas whose backward plan meets the memory and exchange budgets.

Shape legend: P EP ranks, E experts, ``W[e]`` pairs of expert e, ``Q0[e]`` its uncapped quota,
``Q = min(Q0, c)`` the quotas under a common per-expert cap c (``water_fill_np``), caps ``[P]``
the most kept pairs per rank the budgets leave (:meth:`Assignment.rank_caps`).

:class:`BudgetSearch` adds to one mode's :class:`Assignment` the search of step 4 of
controller.py's docstring (:meth:`BudgetSearch.solve`): if the uncapped plan breaks a budget, the
largest cap c that fits, by bisection (:meth:`BudgetSearch.bisect_cap`) or, under the memory
budget alone, where fitting is monotone in c, by a cut-guided search
(:meth:`BudgetSearch.memory_cap`). A trial (:meth:`BudgetSearch.fits`) only asks whether the
rank caps admit an assignment: cheap single-rank and all-rank cuts, the cuts earlier trials
found, then the augmenting paths, whose violated cut is kept. The ``reference_*`` methods are the
slow, obvious versions the tests compare them with.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from megatron_lrmoe.control.assignment import Assignment, Backward
from megatron_lrmoe.control.quota import largest_cap, split_np, water_fill_np

__all__ = ["BudgetSearch"]


class BudgetSearch(Assignment):
    """One mode's planning state (:class:`Assignment`) with the search for the quotas the
    budgets allow."""

    def reference_fits(self, quota: np.ndarray) -> bool:
        """The slow, obvious :meth:`fits`: the whole capped plan, then its budget check."""
        trial = self.backward(quota, with_caps=True)
        return trial is not None and not trial.failed

    def fits(self, quota: np.ndarray) -> bool:
        """Whether ``backward(quota, with_caps=True)`` meets the budgets (:meth:`reference_fits`),
        decided without the min-max part of the assignment where the budgets allow.

        Within the rank caps the memory budget holds by construction, so (unless the exchange
        budget's source side depends on the assignment: save mode with replicas, scope local)
        the answer is whether the caps admit an assignment (:meth:`cut_of`) and the source side
        of the exchange budget, which does not depend on the assignment.
        """
        if self.fits_is_reference():
            return self.reference_fits(quota)
        if self.cut_of(quota) is not None:
            return False
        if self.exchange_budget is not None:
            sent = (
                np.ascontiguousarray(split_np(self.n, quota)).sum(1)
                if self.local_scope
                else np.minimum(self.n, quota[None, :]).sum(1)
            )
            if int(sent.max(initial=0)) * self.cost.exchange_bytes(self.mode) > (
                self.exchange_budget
            ):
                return False
        return True

    def fits_is_reference(self) -> bool:
        """True when :meth:`fits` needs the whole plan: the exchange budget's source side
        depends on the assignment (save mode with replicas, scope local)."""
        return (
            self.exchange_budget is not None
            and self.mode == "save"
            and len(self.holders) > 0
            and self.local_scope
        )

    def cut_of(self, quota: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """None when the rank caps admit an assignment of ``quota``, else a violated cut.

        A cut is a rank set R with what each expert's holders outside R can take,
        ``(outside_R [E], R's mask [P])`` (save mode: their forward pairs; recompute:
        unbounded unless every holder is in R): every assignment puts at least
        ``sum_e max(0, Q[e] - outside_R[e])`` on R, so more than ``sum(caps[R])`` proves that
        none fits. The cheap checks are single-rank and all-rank cuts; then the cuts found so
        far; then the augmenting paths (:func:`caps_cut`), whose cut is kept for later trials.
        """
        caps = self.rank_caps(quota)
        excess = self.per_owner(quota * self.rigid) - caps
        if int(excess.max(initial=0)) > 0:
            return self._cut([int(excess.argmax())])
        if int(quota.sum()) > int(caps.sum()):
            return self._cut(list(range(self.num_sources)))
        for outside, inside in self.cuts.values():
            if int(np.maximum(quota - outside, 0).sum()) > int(caps[inside].sum()):
                return outside, inside
        holders = self.holders
        if not len(holders) or not quota.any():
            return None  # nothing can move, or nothing to place: the checks above decided
        ranks = self.caps_cut(quota, caps.tolist())
        return None if ranks is None else self._cut(ranks)

    def _cut(self, ranks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The cut of rank set ``ranks`` (see :meth:`cut_of`), kept for later trials."""
        inside = np.zeros(self.num_sources, dtype=bool)
        inside[ranks] = True
        key = inside.tobytes()
        if key not in self.cuts:
            self.cuts[key] = (self.outside(inside), inside)
        return self.cuts[key]

    def outside(self, inside: np.ndarray) -> np.ndarray:
        """``[E]`` what each expert's holders outside the rank set ``inside`` (``[P]`` mask) can
        take (:meth:`reference_outside`) from the holder entries: an expert with one holder
        all its pairs unless its owner is inside; a replicated one, in save mode, the forward
        pairs of its holders outside, in recompute mode all its pairs if any holder is
        outside."""
        outside = np.where(inside[self.owner], 0, self.w)
        holders = self.holders
        if len(holders):
            out = ~inside[holders.rank]
            if self.mode == "save":
                taken = np.add.reduceat(holders.forward * out, holders.heads)
            else:
                reach = np.logical_or.reduceat(out, holders.heads)
                taken = np.where(reach, self.w[holders.experts], 0)
            outside[holders.experts] = taken
        return outside

    def reference_outside(self, inside: np.ndarray) -> np.ndarray:
        """The slow, obvious :meth:`outside` from the ``[E, P]`` forward split and holders."""
        if self.mode == "save":
            return self.w - self.forward_load[:, inside].sum(1)
        return np.where((self.holds & ~inside[None, :]).any(1), self.w, 0)

    def solve(self) -> tuple[Backward, Optional[int], tuple[str, ...], tuple[str, ...]]:
        """Quotas under the budgets: ``(plan, cap, binding budgets, unmet budgets)``.

        The cap is the bisection's (:meth:`bisect_cap`): the largest common cap whose capped
        plan meets the budgets, between 0 (known to fit) and the largest quota (known not to).
        Trials ask :meth:`fits`; only the answer gets the whole plan.
        """
        q0 = self.q0
        # A plan within the budgets meets the rank caps, so caps that no assignment meets prove
        # that both plans below break a budget: skip them (the source side of the exchange
        # budget does not depend on the assignment unless ``fits`` asks the full plan).
        budgets = self.memory_budget is not None or self.exchange_budget is not None
        if not budgets or self.fits_is_reference() or self.fits(q0):
            plan = self.backward(q0, with_caps=False)
            if not plan.failed:
                return plan, None, (), ()
            plan = self.backward(q0, with_caps=True)
            if plan is not None and not plan.failed:
                return plan, None, (), ()  # the caps only moved pairs between holders
        if not self.fits(np.zeros_like(q0)):
            # Quota 0 sends nothing, so only the memory budget can stay broken: the saved
            # activations and replicas alone exceed it. Keep no pair, report, never raise.
            return self.backward(np.zeros_like(q0), with_caps=False), 0, ("memory",), ("memory",)
        cap = self.memory_cap() if self.exchange_budget is None else self.bisect_cap()
        plan = self.backward(water_fill_np(q0, cap), with_caps=True)
        return plan, cap, self.binding(cap + 1), ()

    def bisect_cap(self) -> int:
        """The largest common cap that fits, by bisection: lo always fits, hi never."""
        lo, hi = 0, int(self.q0.max(initial=0))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(water_fill_np(self.q0, mid)):
                lo = mid
            else:
                hi = mid
        return lo

    def memory_cap(self) -> int:
        """:meth:`bisect_cap` under the memory budget alone, in a few trials.

        Here the rank caps are the same for every cap tried (only ``keeps_all`` changes them, at
        the top cap, known not to fit) and what a cut R must hold only grows with the cap, so
        the caps that fit are exactly those below some threshold: the bisection's answer is the
        largest cap that fits, whatever the order of trials. Each trial takes the largest cap
        that no cut found so far rules out (:func:`largest_cap`); a cap that fits is then the
        answer, one that does not yields a new cut. The first cuts are the cheap ones the top cap
        broke and the single rank it overloads most (every single-rank cut measured at once).
        After eight trials the rest bisects (each trial at most halves the bracket), so a run of
        weak cuts cannot take long.
        """
        q0 = self.q0
        lo, hi = 0, int(q0.max(initial=0))
        caps = self.rank_caps(np.zeros_like(q0))
        # The most overloaded single rank at the top cap often binds.
        excess = self.single_rank_load(q0) - caps
        if int(excess.max(initial=0)) > 0:
            self._cut([int(excess.argmax())])
        bounds: dict[bytes, int] = {}
        trials = 0
        while True:
            for key, (outside, inside) in self.cuts.items():
                if key not in bounds:
                    bound = largest_cap(q0, outside, int(caps[inside].sum()))
                    bounds[key] = hi if bound is None else bound
            top = min(hi - 1, *bounds.values())
            if top <= lo:
                return lo
            cap = top if trials < 8 else min(top, (lo + hi) // 2)
            trials += 1
            if self.cut_of(water_fill_np(q0, cap)) is None:
                lo = cap
            else:
                hi = cap

    def single_rank_load(self, quota: np.ndarray) -> np.ndarray:
        """``[P]`` what every assignment of ``quota`` puts on each rank g alone, the cut
        ``R = {g}`` (:meth:`reference_single_rank_load`) from the holder entries: an expert with
        one holder keeps its quota there; a replicated one keeps ``max(0, Q - (W - A[e, g]))``
        on a holder in save mode (its other holders take at most their forward pairs), nothing
        in recompute mode (they take any amount)."""
        load = self.per_owner(quota * self.rigid)
        holders = self.holders
        if self.mode == "save" and len(holders):
            stuck = quota[holders.expert] - self.w[holders.expert] + holders.forward
            np.add.at(load, holders.rank, np.maximum(stuck, 0))
        return load

    def reference_single_rank_load(self, quota: np.ndarray) -> np.ndarray:
        """The slow, obvious :meth:`single_rank_load`: the ``outside`` of :meth:`_cut` for every
        single rank at once, ``[E, P]``."""
        if self.mode == "save":
            outside = self.w[:, None] - self.forward_load
        else:  # only a rank that holds an expert alone must keep its pairs
            alone = self.holds & (self.holds.sum(1) == 1)[:, None]
            outside = np.where(alone, 0, self.w[:, None])
        return np.maximum(quota[:, None] - outside, 0).sum(0)

    def binding(self, cap: int) -> tuple[str, ...]:
        """The budgets that each alone rule out the quota cap ``cap``."""
        budgets = {"memory": self.memory_budget, "exchange": self.exchange_budget}
        names = [name for name, value in budgets.items() if value is not None]
        if len(names) == 1:
            return tuple(names)
        quota = water_fill_np(self.q0, cap)
        found = []
        for name in names:
            self.memory_budget = budgets["memory"] if name == "memory" else None
            self.exchange_budget = budgets["exchange"] if name == "exchange" else None
            trial = self.backward(quota, with_caps=True)
            if trial is None or trial.failed:
                found.append(name)
        self.memory_budget, self.exchange_budget = budgets["memory"], budgets["exchange"]
        return tuple(found) or tuple(names)
