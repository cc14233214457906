"""The engine deployment's Ray Serve request router: routing.py's policy over Serve's live replicas.

It runs in the process that holds the deployment handle (the ingress),
once per handle. Requests carry their `RouteKey` as the `route` keyword
(ingress.py) and get their replica's id back in the response; a request
with `replica=ID` goes to that replica only (the ingress's fan-out calls:
/metrics, adapters). In-flight counts are the router's own, kept from
Serve's routed / completed callbacks, so least-loaded needs no probe.
The instance registers itself (routing.register_router) so the ingress can
list the live replicas and read its counters: through a function of another
module, because Serve ships this class to the ingress by value (with copies
of this module's globals), while a function of an importable module travels
by reference.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from native_server.cluster.routing import AffinityTable, Choice, RouteKey, register_router



class AffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, capacity: int | None = None, policy: str = "affinity", **kwargs: Any) -> None:
        """policy: "affinity" (routing.py), or for A/B measurements "random" / "round-robin" / "least-loaded" alone."""
        self.table = AffinityTable(**kwargs)
        self.capacity, self.policy = capacity, policy
        self.rng = random.Random(0)
        self.turn = 0  # round-robin's next turn
        self.in_flight: Counter = Counter()
        self.routes: Counter = Counter()  # (replica, reason) -> requests
        self._requests: dict[str, str] = {}  # internal request id -> replica
        self._known: set[str] = set()
        register_router(self)

    def live(self) -> list[str]:
        return sorted(r.replica_id.unique_id for r in self._replicas_list)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._notice(set(by_id))
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("replica")
        if target is not None:  # a fan-out call: that replica or none
            return [[by_id[target]]] if target in by_id else []
        key = kwargs.get("route")
        key = key if isinstance(key, RouteKey) else RouteKey()
        if not by_id:
            return []
        if self.policy == "random":
            choice = Choice(self.rng.choice(sorted(by_id)), "random")
        elif self.policy == "round-robin":
            ids = sorted(by_id)
            choice, self.turn = Choice(ids[self.turn % len(ids)], "round-robin"), self.turn + 1
        else:
            choice = self.table.choose(key if self.policy == "affinity" else RouteKey(),
                                       {r: self.in_flight[r] for r in by_id}, self.capacity)
        self.table.record(key, choice.replica)
        self.routes[(choice.replica, choice.reason)] += 1
        if pending_request is not None:
            pending_request.kwargs["routed"] = (choice.replica, choice.reason)
        rest = sorted((r for r in by_id if r != choice.replica), key=lambda r: self.in_flight[r])
        return [[by_id[choice.replica]], [by_id[r] for r in rest]]

    def _notice(self, alive: set[str]) -> None:
        for gone in self._known - alive:  # a replacement starts with no users or prefixes
            self.table.forget(gone)
            self.in_flight.pop(gone, None)
        self._known = alive

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] += 1
        self._requests[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._requests.pop(internal_request_id, replica_id.unique_id)
        if self.in_flight[rid] > 0:
            self.in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
