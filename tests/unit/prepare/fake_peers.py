"""In-process stand-ins for the device and reclaim services, to test prepare's gRPC surface alone.

The fake device answers ``Attach`` (or refuses it when asked) and ``Execute`` (a receipt per plan,
or a refusal when asked) and hands every accepted plan to the fake reclaim, which publishes one
``StepEvents`` per plan after ``step_delay_s``: one token per sampling row (id 1000 + n, text
``"t{n} "``), a LENGTH finish at max_tokens, an ABORT finish for aborted ids, and an INTERNAL error
for request ids starting with ``fail``. Enough protocol to drive prepare; no model.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stageserve.server import server_options
from stageserve.v1 import common_pb2, device_pb2, device_pb2_grpc, reclaim_pb2, reclaim_pb2_grpc

ATTACH = dict(
    model_name="fake", vocab_size=49152, eos_token_ids=[2], max_model_len=256, kv_block_size=16, kv_num_blocks=64,
    max_num_seqs=4, max_step_tokens=128, pipeline_depth=2, backend="sim", dtype="float32", dispatch="async",
)


class FakeReclaim(reclaim_pb2_grpc.ReclaimServicer):
    def __init__(self, step_delay_s: float) -> None:
        self.step_delay_s = step_delay_s
        self._subscribers: list[queue.SimpleQueue] = []
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        # device instance id -> request id -> [seq_index, generation, max_tokens, prompt_tokens, produced]
        self._live: dict[str, dict[str, list]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._publish_loop, daemon=True).start()

    def Subscribe(self, request, context):
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._subscribers.append(inbox)
        context.send_initial_metadata(())  # registered: nothing published from now on is missed
        context.add_callback(lambda: inbox.put(None))
        while (item := inbox.get()) is not None:
            yield item

    def submit(self, plan: device_pb2.StepPlan, instance_id: str) -> None:
        self._plans.put((plan, instance_id))

    def _publish_loop(self) -> None:
        while True:
            plan, instance_id = self._plans.get()
            time.sleep(self.step_delay_s)
            published = reclaim_pb2.StepEvents(step_id=plan.step_id, device_instance_id=instance_id, events=self._events(plan, instance_id))
            with self._lock:
                for inbox in self._subscribers:
                    inbox.put(published)

    def _events(self, plan: device_pb2.StepPlan, instance_id: str) -> list[reclaim_pb2.SequenceEvent]:
        live = self._live.setdefault(instance_id, {})  # each device has its own sequence table
        for start in plan.started:
            live[start.request_id] = [start.seq_index, start.generation, start.stop.max_tokens, start.stop.prompt_tokens, 0]
        events = []
        for request_id in plan.aborted:
            if (seq := live.pop(request_id, None)) is not None:
                events.append(self._event(request_id, seq, finish_reason=common_pb2.FINISH_REASON_ABORT))
        by_seq = {(s[0], s[1]): rid for rid, s in live.items()}
        for index, generation, sample in zip(plan.seq_index, plan.generation, plan.sample):
            request_id = by_seq.get((index, generation))
            if not sample or request_id not in live:
                continue
            seq = live[request_id]
            if request_id.startswith("fail"):
                del live[request_id]
                events.append(self._event(request_id, seq, error_code=grpc.StatusCode.INTERNAL.value[0], error_message="boom"))
                continue
            seq[4] += 1
            n = seq[4]
            done = n == seq[2]
            if done:
                del live[request_id]
            events.append(self._event(request_id, seq, token_ids=[1000 + n], text=f"t{n} ",
                                      finish_reason=common_pb2.FINISH_REASON_LENGTH if done else 0))
        return events

    @staticmethod
    def _event(request_id: str, seq: list, **fields) -> reclaim_pb2.SequenceEvent:
        return reclaim_pb2.SequenceEvent(
            request_id=request_id, seq_index=seq[0], generation=seq[1], prompt_tokens=seq[3], completion_tokens=seq[4], **fields
        )


class FakeDevice(device_pb2_grpc.DeviceServicer):
    def __init__(self, reclaim: FakeReclaim, **attach_overrides) -> None:
        self.reclaim = reclaim
        self.attach = device_pb2.AttachReply(**{**ATTACH, **attach_overrides}, instance_id=uuid.uuid4().hex)
        self.refuse_steps_with_request: str = ""  # refuse any plan with a row of this request id
        self.refuse_attach: str = ""  # when set: Attach fails with UNAVAILABLE and this message
        self.attach_calls = 0
        self.plans: list[device_pb2.StepPlan] = []
        self._names: dict[tuple[int, int], str] = {}

    def Attach(self, request, context):
        self.attach_calls += 1
        if self.refuse_attach:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.refuse_attach)
        return self.attach

    def Execute(self, request_iterator, context):
        for plan in request_iterator:
            self.plans.append(plan)
            for start in plan.started:
                self._names[(start.seq_index, start.generation)] = start.request_id
            rows = {self._names.get(key) for key in zip(plan.seq_index, plan.generation)}
            if self.refuse_steps_with_request and self.refuse_steps_with_request in rows:
                yield device_pb2.StepReceipt(step_id=plan.step_id, error="refused on purpose")
                continue
            self.reclaim.submit(plan, self.attach.instance_id)
            yield device_pb2.StepReceipt(step_id=plan.step_id, ticket=plan.step_id)


class FakePeers:
    """Both fakes on loopback; ``restart_device`` brings up a new device instance on the same port."""

    def __init__(self, step_delay_s: float = 0.01, **attach_overrides) -> None:
        self._attach_overrides = attach_overrides
        self.reclaim = FakeReclaim(step_delay_s)
        self._reclaim_server, self.reclaim_port = self._serve(reclaim_pb2_grpc.add_ReclaimServicer_to_server, self.reclaim, 0)
        self.device = FakeDevice(self.reclaim, **attach_overrides)
        self._device_server, self.device_port = self._serve(device_pb2_grpc.add_DeviceServicer_to_server, self.device, 0)

    @staticmethod
    def _serve(add, servicer, port: int, host: str = "127.0.0.1") -> tuple[grpc.Server, int]:
        """Serve ``servicer`` on ``host:port`` with health (every service SERVING, as a ready peer)."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=server_options())  # accepts prepare's keepalive pings
        add(servicer, server)
        status = health.HealthServicer(experimental_non_blocking=True)
        for name in ("stageserve.v1.Device", "stageserve.v1.Reclaim"):
            status.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        server.start()
        return server, bound

    def add_device(self, host: str) -> tuple[FakeDevice, grpc.Server]:
        """A second device, publishing through the same fake reclaim, on ``host`` and the first device's port
        (as the pods behind one headless Service: one port, several addresses; any 127.x.y.z is loopback)."""
        device = FakeDevice(self.reclaim, **self._attach_overrides)
        server, _ = self._serve(device_pb2_grpc.add_DeviceServicer_to_server, device, self.device_port, host)
        return device, server

    def stop_device(self) -> None:
        self._device_server.stop(0).wait()

    def restart_device(self) -> None:
        self.device = FakeDevice(self.reclaim, **self._attach_overrides)
        self._device_server, _ = self._serve(device_pb2_grpc.add_DeviceServicer_to_server, self.device, self.device_port)

    def stop(self) -> None:
        self._device_server.stop(0).wait()
        self._reclaim_server.stop(0).wait()
