"""Plans the compile backend proposes, one per captured graph, and how ranks agree to switch to them.

Note [Plan agreement]
~~~~~~~~~~~~~~~~~~~~~
The backend plans buckets while Dynamo compiles, in the middle of a forward, possibly on one rank only (a
recompile for a shape only that rank saw). It must not issue a collective there, and the Reducer must not
switch plans under a backward in flight. So a graph's plan is only *proposed*:

1. the composite of all proposed graph plans gets two tokens (two independent 20-bit slices of its
   fingerprint, plus one; 0 for "none");
2. the usage map all-reduced after the last bucket (Note [Reducer]) carries each ``token`` and ``token**2``;
   the sums equal ``n * token`` and ``n * token**2`` for the ``n`` participating ranks exactly when every rank
   contributed the same token (equality in Cauchy-Schwarz), so different plans agree only if both 20-bit
   slices of their fingerprints collide;
3. at the next forward every rank adopts it, or, when the tokens disagree, every rank gathers the plans and
   raises the same error naming the first differing bucket. Ranks never reduce mismatched buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

from .passes import BucketPlan, ParamSpec, compose_plans


class GraphPlans:
    """The graph plans proposed so far, composed into the one plan the Reducer would switch to."""

    def __init__(self, specs_in_registration_order: Sequence[ParamSpec]) -> None:
        self._specs = list(specs_in_registration_order)
        self._by_graph: dict[str, tuple[int, BucketPlan]] = {}  # graph -> (position in forward, plan)
        self._next_position = 0
        self.proposed: BucketPlan | None = None

    def propose(self, graph: str, plan: BucketPlan, current: BucketPlan) -> None:
        """Record ``plan`` for ``graph``, compiled now. Graphs are first compiled in the order forward runs them;
        a recompile (a graph with the same parameters) replaces the old plan and keeps its position."""
        names = set(plan.param_names)
        same = [k for k, (_, old) in self._by_graph.items() if set(old.param_names) == names]
        position = self._by_graph.pop(same[0])[0] if same else self._next_position
        self._next_position += not same
        self._by_graph[graph] = (position, plan)
        in_forward_order = [p for _, p in sorted(self._by_graph.values(), key=lambda item: item[0])]
        composite = compose_plans(
            in_forward_order,
            self._specs[::-1],
            caps=current.caps,
        )
        self.proposed = None if composite.fingerprint == current.fingerprint else composite

    @property
    def graphs(self) -> dict[str, BucketPlan]:
        return {k: plan for k, (_, plan) in self._by_graph.items()}

    def tokens(self) -> tuple[int, int]:
        """What this rank contributes to the agreement (see the Note); zeros when nothing is proposed."""
        if self.proposed is None:
            return (0, 0)
        fingerprint = self.proposed.fingerprint
        return (int(fingerprint[:5], 16) + 1, int(fingerprint[5:10], 16) + 1)

    def taken(self) -> None:
        self.proposed = None


def agreement_entries(tokens: tuple[int, ...]) -> list[int]:
    """The entries a rank adds to the usage all-reduce: each token and its square."""
    return [v for t in tokens for v in (t, t * t)]


def agreed(tokens: tuple[int, ...], sums: list[int], ranks: int) -> bool | None:
    """True: every rank proposed this plan. False: ranks disagree. None: nobody proposed anything.

    ``sums`` are the all-reduced ``agreement_entries`` of the ``ranks`` participating ranks.
    """
    if not any(sums):
        return None
    return all(t != 0 and s == ranks * t and q == ranks * t * t for t, s, q in zip(tokens, sums[0::2], sums[1::2]))
