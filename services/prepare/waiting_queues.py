"""The scheduler's waiting requests, queued per tenant (API key) and admitted in the tenants' turns.

The keys file gives a key its limits (`stageserve.security.keys.TenantLimits`); each request
carries its key's (``GenerationRequest.tenant_limits``).

Each tenant's requests wait first come, first served; the tenants take turns (deficit round robin
with a quantum of ``weight`` admissions per turn: Shreedhar and Varghese, SIGCOMM 1995), so one
key's burst of requests cannot delay another key's first admission by more than one turn. A tenant
at its ``max_running`` sequences is passed over until one of them ends. On a deployment without
keys every request is the one tenant's, and this is the plain FIFO queue it always was.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from stageserve.prepare.validation import GenerationRequest




class WaitingQueues:
    """Waiting requests by tenant (``GenerationRequest.tenant``), taken in the tenants' turns."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[GenerationRequest]] = OrderedDict()  # turn order: first is next
        self._spent = 0  # admissions the first tenant has had in its current turn
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[GenerationRequest]:
        return (request for queue in self._queues.values() for request in queue)

    def __contains__(self, request: GenerationRequest) -> bool:
        queue = self._queues.get(request.tenant)
        return queue is not None and request in queue

    def waiting_of(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting."""
        queue = self._queues.get(tenant)
        return len(queue) if queue else 0

    def append(self, request: GenerationRequest) -> None:
        self._queues.setdefault(request.tenant, deque()).append(request)
        self._count += 1

    def remove(self, request: GenerationRequest) -> None:
        """Drop a waiting ``request`` (aborted). Raises ValueError when it is not waiting."""
        queue = self._queues[request.tenant]
        queue.remove(request)
        self._count -= 1
        if not queue:
            self._drop_turn(request.tenant)

    def head(self, may_run: Callable[[GenerationRequest], bool]) -> GenerationRequest | None:
        """The request whose turn it is: the oldest of the first tenant in turn order whose oldest
        ``may_run`` (its tenant is not at its ``max_running``); ``None`` when no tenant's may."""
        return next((queue[0] for queue in self._queues.values() if may_run(queue[0])), None)

    def pop(self, request: GenerationRequest, weight: int) -> None:
        """Admit ``request``, a `head`: its tenant has had one more admission of its turn of
        ``weight``; at the end of the turn (or of its queue) the tenant goes to the back."""
        tenant = request.tenant
        queue = self._queues[tenant]
        queue.popleft()
        self._count -= 1
        while (first := next(iter(self._queues))) != tenant:  # tenants passed over (at their max_running): their turn ends
            self._queues.move_to_end(first)
            self._spent = 0
        self._spent += 1
        if not queue:
            self._drop_turn(tenant)
        elif self._spent >= weight:
            self._queues.move_to_end(tenant)
            self._spent = 0

    def _drop_turn(self, tenant: str) -> None:
        if next(iter(self._queues)) == tenant:
            self._spent = 0
        del self._queues[tenant]
