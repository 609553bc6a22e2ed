"""The reclaim service's servicer: ``Reclaim.Subscribe`` streams every published step's events out.

The devices' completion streams come in through ``links.py``; the service is assembled in
``assembly.py`` and started by ``main.py``.
"""

from __future__ import annotations

import grpc

from stageserve.reclaim.publisher import Publisher, Subscription, TooManySubscribers
from stageserve.v1 import reclaim_pb2, reclaim_pb2_grpc

SERVICE_NAME = "stageserve.v1.Reclaim"


class ReclaimServicer(reclaim_pb2_grpc.ReclaimServicer):
    """``Reclaim.Subscribe``: stream every published ``StepEvents`` from now on."""

    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    def Subscribe(self, request: reclaim_pb2.SubscribeRequest, context: grpc.ServicerContext):
        try:
            subscription: Subscription = self._publisher.subscribe(request.peer or context.peer())
        except TooManySubscribers as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        context.add_callback(lambda: self._publisher.unsubscribe(subscription))
        # Headers now, so the subscriber knows it is subscribed before it sends any plan.
        context.send_initial_metadata(())
        yield from subscription
        if subscription.drop_reason:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, subscription.drop_reason)
