"""The device service as a real process: readiness after warm-up, reflection, Attach, and the
Execute + Complete streams driven by this test in the roles of prepare and reclaim.

The reference for sampled tokens is the same model loaded in this process (float32, greedy).
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.launcher import ServiceProcess
from stageserve.v1 import common_pb2, device_pb2, device_pb2_grpc

# "The capital of France is" in the embedded model's tokenizer.
PROMPT = [504, 3575, 282, 4649, 314]
KV_MEMORY = 64 * 1024**2
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


class ExecuteStream:
    """This test as prepare: one plan in, one receipt out (the call fails rather than hang after 120 s)."""

    def __init__(self, stub: device_pb2_grpc.DeviceStub) -> None:
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._receipts = stub.Execute(iter(self._plans.get, None), timeout=120)

    def send(self, plan: device_pb2.StepPlan) -> device_pb2.StepReceipt:
        self._plans.put(plan)
        return next(self._receipts)

    def send_only(self, plan: device_pb2.StepPlan) -> None:
        """Send ``plan`` without reading a receipt (a plan with ``refusals_only``)."""
        self._plans.put(plan)

    def close(self) -> None:
        """Half-close and read the stream to its end, so the device has closed it too."""
        self._plans.put(None)
        for _ in self._receipts:
            pass


class CompleteStream:
    """This test as reclaim: collects completion events, sends slot releases."""

    def __init__(self, stub: device_pb2_grpc.DeviceStub) -> None:
        self._stub = stub
        self._open()

    def _open(self) -> None:
        self._releases: queue.SimpleQueue = queue.SimpleQueue()
        self._call = self._stub.Complete(iter(self._releases.get, None))
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for event in self._call:
                self.events.put(event)
        except grpc.RpcError as exc:
            self.error = exc

    def next(self, kind: str, timeout: float = 60) -> device_pb2.CompletionTicket | device_pb2.StepOutput:
        event = self.events.get(timeout=timeout)
        assert event.WhichOneof("kind") == kind, event
        return getattr(event, kind)

    def next_ticket(self, timeout: float = 60) -> device_pb2.CompletionTicket:
        """The next ticket, past any outputs of earlier steps: the protocol puts each ticket before
        its own output, not before the outputs of the steps submitted ahead of it."""
        while (event := self.events.get(timeout=timeout)).WhichOneof("kind") != "ticket":
            pass
        return event.ticket

    def release(self, ticket: int) -> None:
        self._releases.put(device_pb2.SlotRelease(ticket=ticket))

    def reconnect(self) -> None:
        """Vanish as a reclaim does when it restarts, then attach again (the device may take a moment
        to notice the old stream is gone, refusing the new one with FAILED_PRECONDITION meanwhile)."""
        self.close()
        for _ in range(100):
            self._open()
            self._reader.join(0.3)
            if self.error is None:
                return
            assert self.error.code() == grpc.StatusCode.FAILED_PRECONDITION, self.error
        raise AssertionError("the device kept refusing a new Complete stream")

    def close(self) -> None:
        self._releases.put(None)
        self._call.cancel()
        self._reader.join(10)


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """A device process (float32, small KV pool) and the readiness statuses seen while it started."""
    workdir: Path = tmp_path_factory.mktemp("device")
    process = ServiceProcess(
        "device", ["--dtype", "float32", "--kv-cache-memory", str(KV_MEMORY), "--max-num-seqs", "8", "--max-model-len", "512"],
        workdir, 0, workdir / "device.log",
    ).start()
    try:
        process.wait_port()
        statuses, early_attach = [], None
        with grpc.insecure_channel(process.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(service="stageserve.v1.Device"), timeout=5).status
                if not statuses or statuses[-1] != status:
                    statuses.append(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if early_attach is None:
                    try:
                        device_pb2_grpc.DeviceStub(channel).Attach(device_pb2.AttachRequest(peer="test"), timeout=5)
                        early_attach = grpc.StatusCode.OK
                    except grpc.RpcError as exc:
                        early_attach = exc.code()
                time.sleep(0.05)
        yield process, statuses, early_attach
    finally:
        code = process.stop()
        if code not in (0, None):
            print((workdir / "device.log").read_text()[-5000:])


@pytest.fixture(scope="module")
def stub(device):
    with grpc.insecure_channel(device[0].address) as channel:
        yield device_pb2_grpc.DeviceStub(channel)


@pytest.fixture(scope="module")
def reclaim(stub):
    stream = CompleteStream(stub)
    try:
        yield stream
    finally:
        stream.close()


@pytest.fixture(scope="module")
def reference_tokens():
    """The first three greedy tokens after PROMPT from the same model in this process, with the device's default ``--weights auto``."""
    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.model.forward_batch import build_forward_batch
    from stageserve.device.model.decoder import DecoderModel
    from stageserve.model_files import embedded_model_path

    model = DecoderModel.from_path(embedded_model_path(), torch.float32, "cpu", weight_format="auto")
    ids, tokens = list(PROMPT), []
    for _ in range(3):
        kv = PagedKVCache(model.config, 1, 16, torch.float32, "cpu")
        tokens.append(int(model.forward(build_forward_batch([(ids, 0, [0], True)], 16, "cpu"), kv).argmax(-1)[0]))
        ids.append(tokens[-1])
    return tokens


def prefill_plan(step_id: int, seq_index: int, generation: int, blocks: list[int], sampling=GREEDY) -> device_pb2.StepPlan:
    start = common_pb2.SequenceStart(seq_index=seq_index, generation=generation, request_id=f"req-{step_id}",
                                     sampling=sampling, prompt_token_ids=PROMPT)
    return device_pb2.StepPlan(step_id=step_id, started=[start], seq_index=[seq_index], generation=[generation], start_pos=[0],
                               num_tokens=[len(PROMPT)], token_ids=PROMPT, sample=[True], num_new_blocks=[len(blocks)], new_block_ids=blocks)


def decode_plan(step_id: int, seq_index: int, generation: int, start_pos: int) -> device_pb2.StepPlan:
    return device_pb2.StepPlan(step_id=step_id, seq_index=[seq_index], generation=[generation], start_pos=[start_pos],
                               num_tokens=[1], token_ids=[-1], sample=[True], num_new_blocks=[0])


def test_readiness_turns_serving_only_after_warm_up(device):
    _, statuses, early_attach = device
    assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    assert early_attach == grpc.StatusCode.UNAVAILABLE  # model facts exist only after warm-up


def test_grpcurl_lists_the_device_service(device):
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    listed = subprocess.run([grpcurl, "-plaintext", device[0].address, "list"], capture_output=True, text=True, timeout=30, check=True)
    assert "stageserve.v1.Device" in listed.stdout.split()
    assert "grpc.health.v1.Health" in listed.stdout.split()


def test_attach_reports_model_and_pool_facts(stub):
    facts = stub.Attach(device_pb2.AttachRequest(peer="test"), timeout=10)
    assert facts.model_name == "SmolLM2-135M-Instruct"
    assert facts.vocab_size == 49152 and list(facts.eos_token_ids) == [2]
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; float32 K and V -> 737,280 bytes per 16-token block.
    assert facts.kv_block_size == 16 and facts.kv_num_blocks == KV_MEMORY // 737_280
    assert facts.max_model_len == 512 and facts.max_num_seqs == 8 and facts.max_step_tokens == 2048
    assert (facts.pipeline_depth, facts.backend, facts.dtype, facts.dispatch) == (2, "cpu", "float32", "async")
    assert len(facts.instance_id) == 32


def test_execute_and_complete_round_trip_matches_the_in_process_model(stub, reclaim, reference_tokens):
    execute = ExecuteStream(stub)
    try:
        receipt = execute.send(prefill_plan(1, seq_index=3, generation=7, blocks=[5]))
        assert receipt.error == "" and receipt.ticket > 0 and receipt.step_id == 1
        ticket = reclaim.next("ticket")
        assert (ticket.ticket, ticket.step_id, ticket.slot) == (receipt.ticket, 1, receipt.slot)
        assert list(ticket.seq_index) == [3] and list(ticket.generation) == [7]
        assert [s.request_id for s in ticket.started] == ["req-1"]
        output = reclaim.next("output")
        assert output.ticket == receipt.ticket and output.error == ""
        assert list(output.token_ids) == reference_tokens[:1]
        reclaim.release(output.ticket)
        # Two decode steps with placeholders: the device substitutes the token it sampled last.
        for k in (1, 2):
            receipt = execute.send(decode_plan(1 + k, seq_index=3, generation=7, start_pos=len(PROMPT) + k - 1))
            assert receipt.error == ""
            assert reclaim.next("ticket").ticket == receipt.ticket
            output = reclaim.next("output")
            assert list(output.token_ids) == reference_tokens[k : k + 1]
            reclaim.release(output.ticket)
    finally:
        execute.close()


def test_invalid_sampling_params_are_refused_with_the_field_named(stub, reclaim):
    execute = ExecuteStream(stub)
    try:
        bad = common_pb2.SamplingParams(temperature=0.7, top_p=1.5, repetition_penalty=1.0)
        receipt = execute.send(prefill_plan(1, seq_index=0, generation=1, blocks=[1], sampling=bad))
        assert receipt.ticket == 0 and "sampling.top_p" in receipt.error
        # The same stream keeps working.
        receipt = execute.send(prefill_plan(2, seq_index=0, generation=1, blocks=[1]))
        assert receipt.error == "" and receipt.ticket > 0
        assert reclaim.next("ticket").ticket == receipt.ticket
        reclaim.release(reclaim.next("output").ticket)
    finally:
        execute.close()


def test_a_plan_with_refusals_only_is_answered_only_when_refused(stub, reclaim, reference_tokens):
    """prepare's plans: an accepted one sends its ticket and output to reclaim and no receipt; a
    refused one its receipt, the next receipt on the stream (so no success receipt came before it)."""
    execute = ExecuteStream(stub)
    try:
        accepted = prefill_plan(1, seq_index=0, generation=1, blocks=[1])
        accepted.refusals_only = True
        execute.send_only(accepted)
        ticket = reclaim.next("ticket")
        assert ticket.step_id == 1
        output = reclaim.next("output")
        assert output.ticket == ticket.ticket and list(output.token_ids) == reference_tokens[:1]
        reclaim.release(output.ticket)
        refused = decode_plan(2, seq_index=5, generation=1, start_pos=5)
        refused.refusals_only = True
        receipt = execute.send(refused)
        assert receipt.step_id == 2 and receipt.ticket == 0 and "not started" in receipt.error
    finally:
        execute.close()


def test_bad_block_id_is_refused_without_killing_the_service(stub, reclaim, reference_tokens, device):
    execute = ExecuteStream(stub)
    try:
        facts = stub.Attach(device_pb2.AttachRequest(peer="test"), timeout=10)
        receipt = execute.send(prefill_plan(1, seq_index=1, generation=1, blocks=[facts.kv_num_blocks]))
        assert receipt.ticket == 0 and "new_block_ids" in receipt.error and str(facts.kv_num_blocks) in receipt.error
        # A decode row for a sequence that never started, and a placeholder with no sampled token, are refused too.
        assert "not started" in execute.send(decode_plan(2, seq_index=2, generation=1, start_pos=5)).error
        receipt = execute.send(prefill_plan(3, seq_index=1, generation=1, blocks=[2]))
        assert receipt.error == ""
        assert reclaim.next("ticket").ticket == receipt.ticket
        output = reclaim.next("output")
        assert list(output.token_ids) == reference_tokens[:1]
        reclaim.release(output.ticket)
        assert "stale" in execute.send(decode_plan(4, seq_index=1, generation=2, start_pos=len(PROMPT))).error
    finally:
        execute.close()
    assert device[0].process.poll() is None


def test_a_second_execute_stream_is_refused_while_one_is_open(stub, reclaim):
    first = ExecuteStream(stub)
    try:
        receipt = first.send(device_pb2.StepPlan(step_id=1))  # an empty plan: the stream is now open on the device
        assert reclaim.next("ticket").ticket == receipt.ticket
        reclaim.release(reclaim.next("output").ticket)
        second = ExecuteStream(stub)
        with pytest.raises(grpc.RpcError) as refused:
            second.send(device_pb2.StepPlan(step_id=1))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        first.close()


def test_a_second_complete_stream_is_refused_while_reclaim_is_attached(stub, reclaim):
    second = CompleteStream(stub)
    second._reader.join(30)
    assert second.error is not None and second.error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_slots_held_by_a_vanished_reclaim_are_released(stub, reclaim):
    execute = ExecuteStream(stub)
    try:
        # Fill both slots; reclaim reads the tickets but vanishes without releasing them.
        for step_id, seq in ((1, 4), (2, 5)):
            assert execute.send(prefill_plan(step_id, seq_index=seq, generation=1, blocks=[10 + seq])).error == ""
            reclaim.next_ticket()  # step 1's output may come before step 2's ticket
        reclaim.reconnect()
        # Without the release on disconnect, this submit would wait for a slot forever (the call times out).
        receipt = execute.send(prefill_plan(3, seq_index=6, generation=1, blocks=[20]))
        assert receipt.error == "" and receipt.ticket > 0
        ticket = reclaim.next("ticket")
        assert ticket.ticket == receipt.ticket  # the vanished stream's events are not replayed
        output = reclaim.next("output")
        assert output.ticket == receipt.ticket and len(output.token_ids) == 1
        reclaim.release(output.ticket)
    finally:
        execute.close()


def test_an_unloadable_model_exits_with_code_2_naming_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a GGUF file")
    finished = subprocess.run([sys.executable, "-m", "stageserve", "device", "--model", str(bad), "--port", "0", "--metrics-port", "off"],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2
    errors = [line for line in finished.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(bad) in errors[0] and "not a GGUF file" in errors[0]


def test_a_plan_writing_a_block_another_sequence_owns_is_refused_on_that_step(stub, reclaim):
    execute = ExecuteStream(stub)
    try:
        receipt = execute.send(prefill_plan(1, seq_index=0, generation=1, blocks=[30]))
        assert receipt.error == ""
        assert reclaim.next("ticket").ticket == receipt.ticket
        reclaim.release(reclaim.next("output").ticket)
        # Another sequence's prompt would overwrite sequence 0's block 30: refused, nothing runs.
        refused = execute.send(prefill_plan(2, seq_index=1, generation=1, blocks=[30]))
        assert refused.ticket == 0 and "writes KV block 30, which another live sequence holds" in refused.error
        # The stream and sequence 0 carry on.
        receipt = execute.send(decode_plan(3, seq_index=0, generation=1, start_pos=len(PROMPT)))
        assert receipt.error == "" and reclaim.next("ticket").ticket == receipt.ticket
        reclaim.release(reclaim.next("output").ticket)
    finally:
        execute.close()


def test_undecodable_messages_are_invalid_argument(device):
    with grpc.insecure_channel(device[0].address) as channel:  # no serializers: raw bytes on the wire
        with pytest.raises(grpc.RpcError) as unary:
            channel.unary_unary("/stageserve.v1.Device/Attach")(b"\xff\xff", timeout=10)
        with pytest.raises(grpc.RpcError) as streamed:
            list(channel.stream_stream("/stageserve.v1.Device/Execute")(iter([b"\xff\xff"]), timeout=10))
    for failed in (unary.value, streamed.value):
        assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not decode as its protobuf type" in failed.details()
    assert device[0].process.poll() is None
