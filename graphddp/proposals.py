"""Plans the compile backend proposes, one per captured graph, and how ranks agree to switch to them.

Note [Plan agreement]
~~~~~~~~~~~~~~~~~~~~~
The backend plans buckets while Dynamo compiles, in the middle of a forward, possibly on one rank only (a
recompile for a shape only that rank saw). It must not issue a collective there, and the Reducer must not
switch plans under a backward in flight. So a graph's plan is only *proposed*:

1. the composite of all proposed graph plans gets a token (20 bits of its fingerprint, 0 for "none");
2. the usage map all-reduced after the last bucket (Note [Reducer]) carries ``token`` and ``token**2``;
   the sums equal ``n * token`` and ``n * token**2`` for the ``n`` participating ranks exactly when every rank
   proposed the same plan;
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
        self._position = {s.name: i for i, s in enumerate(self._specs)}
        self._by_graph: dict[str, BucketPlan] = {}
        self.proposed: BucketPlan | None = None

    def propose(self, graph: str, plan: BucketPlan, current: BucketPlan) -> None:
        """Record ``plan`` for ``graph``; a graph sharing parameters with it (an older compile) is replaced."""
        names = set(plan.param_names)
        for key in [k for k, old in self._by_graph.items() if names & set(old.param_names)]:
            del self._by_graph[key]
        self._by_graph[graph] = plan
        # Graphs run in forward order; their backwards in reverse. The first registered parameter of each
        # graph stands in for its position in forward.
        in_backward_order = sorted(
            self._by_graph.values(), key=lambda p: -min(self._position[n] for n in p.param_names)
        )
        composite = compose_plans(
            in_backward_order,
            self._specs[::-1],
            bucket_cap_bytes=current.bucket_cap_bytes,
            first_bucket_cap_bytes=current.first_bucket_cap_bytes,
        )
        self.proposed = None if composite.fingerprint == current.fingerprint else composite

    @property
    def graphs(self) -> dict[str, BucketPlan]:
        return dict(self._by_graph)

    def token(self) -> int:
        """What this rank contributes to the agreement (see the Note); 0 when nothing is proposed."""
        return 0 if self.proposed is None else int(self.proposed.fingerprint[:5], 16) + 1

    def taken(self) -> None:
        self.proposed = None


def agreed(token: int, token_sum: int, square_sum: int, ranks: int) -> bool | None:
    """True: every rank proposed this plan. False: ranks disagree. None: nobody proposed anything."""
    if token_sum == 0 and square_sum == 0:
        return None
    return token != 0 and token_sum == ranks * token and square_sum == ranks * token * token
