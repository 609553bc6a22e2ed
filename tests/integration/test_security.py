"""A deployment secured as on a shared cluster: mutual TLS between the three services (certificates
made by ``tests/security_certs.py``), API keys on prepare's gRPC and HTTP APIs, an admin key, and the
plaintext health-only port; attacked from outside as issue 19 did."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.security.guard import BAD_KEY, NO_KEY
from stageserve.server import HEALTH_PORT_SUFFIX
from stageserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, device_pb2, device_pb2_grpc, prepare_pb2, prepare_pb2_grpc
from stageserve.v1 import reclaim_pb2, reclaim_pb2_grpc
from tests.security_certs import Authority

from .conftest import launch

KEY_A = "key-of-team-a-0123456789"
KEY_B = "key-of-team-b-0123456789"
ADMIN_KEY = "key-of-the-operators-0123"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """(pipeline, the services' TLS files, a certificate of another CA)."""
    folder = tmp_path_factory.mktemp("secured-files")
    files = Authority.create("stageserve test CA").issue(folder / "tls", "stageserve")
    stranger = Authority.create("another CA").issue(folder / "stranger", "stranger")
    (folder / "api-keys").write_text(f"{KEY_A} team-a\nsha256:{hashlib.sha256(KEY_B.encode()).hexdigest()} team-b\n")
    (folder / "admin-keys").write_text(f"{ADMIN_KEY} ops\n")
    pipeline = launch(tmp_path_factory, "secured", tls=files, prepare_args=[
        "--api-keys-file", str(folder / "api-keys"), "--admin-keys-file", str(folder / "admin-keys"),
        "--http-port", "0", "--health-port", "0"])
    try:
        yield pipeline, files, stranger
    finally:
        pipeline.stop()


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def public(secured):
    """A Generation stub over TLS that trusts the CA and has no client certificate (a public client)."""
    pipeline, files, _ = secured
    with grpc.secure_channel(pipeline.prepare.address, grpc.ssl_channel_credentials(files.ca.read_bytes())) as channel:
        yield prepare_pb2_grpc.GenerationStub(channel), channel


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


def test_the_public_api_needs_a_key(public):
    stub, _ = public
    info = prepare_pb2.GetModelInfoRequest()
    assert refusal(lambda: stub.GetModelInfo(info, timeout=30)) == (grpc.StatusCode.UNAUTHENTICATED, NO_KEY)
    assert refusal(lambda: stub.GetModelInfo(info, metadata=bearer("a-wrong-key-0123456789"), timeout=30)) == \
        (grpc.StatusCode.UNAUTHENTICATED, BAD_KEY)
    assert stub.GetModelInfo(info, metadata=bearer(KEY_A), timeout=30).model_name == "SmolLM2-135M-Instruct"
    reply = stub.Generate(prepare_pb2.GenerateRequest(prompt="Hello", max_tokens=2), metadata=bearer(KEY_B), timeout=120)
    assert len(reply.token_ids) == 2


def test_a_key_can_neither_abort_nor_detect_another_keys_request(public):
    stub, _ = public
    long = prepare_pb2.GenerateRequest(request_id="job-1", prompt="Count to a thousand:", max_tokens=200, ignore_eos=True)
    stream = stub.GenerateStream(long, metadata=bearer(KEY_A), timeout=300)
    first = next(stream)  # team-a's job-1 runs
    assert first.request_id == "job-1"
    # team-b: the id is free (no ALREADY_EXISTS), and Abort finds no running job-1
    theirs = stub.Generate(prepare_pb2.GenerateRequest(request_id="job-1", prompt="Hi", max_tokens=2), metadata=bearer(KEY_B), timeout=120)
    assert theirs.request_id == "job-1" and len(theirs.token_ids) == 2
    assert not stub.Abort(prepare_pb2.AbortRequest(request_id="job-1"), metadata=bearer(KEY_B), timeout=30).aborted
    # team-a's own id is taken, and team-a can abort it
    code, details = refusal(lambda: stub.Generate(prepare_pb2.GenerateRequest(request_id="job-1", prompt="Hi", max_tokens=2),
                                                   metadata=bearer(KEY_A), timeout=120))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'job-1'" in details and "team-a" not in details
    assert stub.Abort(prepare_pb2.AbortRequest(request_id="job-1"), metadata=bearer(KEY_A), timeout=30).aborted
    assert [chunk for chunk in stream][-1].finish_reason == common_pb2.FINISH_REASON_ABORT


def test_admin_needs_an_admin_key_and_a_profile_name_is_not_a_path(public, secured, tmp_path):
    _, channel = public
    admin = admin_pb2_grpc.AdminStub(channel)
    stop = admin_pb2.StopProfileRequest(local_only=True)
    assert refusal(lambda: admin.StopProfile(stop, timeout=30))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert refusal(lambda: admin.StopProfile(stop, metadata=bearer(KEY_A), timeout=30))[0] == grpc.StatusCode.PERMISSION_DENIED
    for name in ("../escape", str(tmp_path / "abs")):
        code, details = refusal(lambda: admin.StartProfile(admin_pb2.StartProfileRequest(name=name), metadata=bearer(ADMIN_KEY), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no paths or separators" in details
    assert not (tmp_path / "abs").exists()
    # Through prepare, the admin key profiles all three (prepare reaches its peers over mutual TLS).
    started = admin.StartProfile(admin_pb2.StartProfileRequest(name="secured-run"), metadata=bearer(ADMIN_KEY), timeout=30)
    assert [part.service for part in started.services] == ["prepare", "device", "reclaim"]
    stopped = admin.StopProfile(admin_pb2.StopProfileRequest(), metadata=bearer(ADMIN_KEY), timeout=60)
    assert all(part.trace_file.endswith(".trace.json") for part in stopped.services)


def internal_calls(channel: grpc.Channel) -> dict[str, object]:
    """One call of each internal RPC an outsider would try: Attach, Execute, Complete, Subscribe."""
    device, reclaim = device_pb2_grpc.DeviceStub(channel), reclaim_pb2_grpc.ReclaimStub(channel)
    return {
        "Attach": lambda metadata: device.Attach(device_pb2.AttachRequest(peer="outsider"), metadata=metadata, timeout=30),
        "Execute": lambda metadata: list(device.Execute(iter([device_pb2.StepPlan(step_id=1)]), metadata=metadata, timeout=30)),
        "Complete": lambda metadata: next(device.Complete(iter(()), metadata=metadata, timeout=30)),
        "Subscribe": lambda metadata: next(reclaim.Subscribe(reclaim_pb2.SubscribeRequest(peer="outsider"), metadata=metadata, timeout=30)),
    }


@pytest.mark.parametrize("rpc", ["Attach", "Execute", "Complete", "Subscribe"])
def test_internal_rpcs_refuse_callers_without_a_trusted_client_certificate(secured, rpc):
    pipeline, files, stranger = secured
    address = pipeline.reclaim.address if rpc == "Subscribe" else pipeline.device.address
    ca = files.ca.read_bytes()
    for credentials in (grpc.ssl_channel_credentials(ca),  # a public client with an API key, no certificate
                        grpc.ssl_channel_credentials(ca, stranger.key.read_bytes(), stranger.cert.read_bytes())):  # another CA's
        with grpc.secure_channel(address, credentials) as channel:
            code, _ = refusal(lambda: internal_calls(channel)[rpc](bearer(ADMIN_KEY)))
            assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails: nothing reaches the service
    with grpc.insecure_channel(address) as channel:
        assert refusal(lambda: internal_calls(channel)[rpc](None))[0] == grpc.StatusCode.UNAVAILABLE


def test_a_peer_with_a_certificate_of_the_ca_is_served(secured):
    pipeline, files, _ = secured
    with grpc.secure_channel(pipeline.device.address, files.channel_credentials()) as channel:
        assert internal_calls(channel)["Attach"](None).model_name == "SmolLM2-135M-Instruct"


def test_a_server_certificate_of_another_ca_fails_the_handshake(secured):
    pipeline, _, stranger = secured
    with grpc.secure_channel(pipeline.prepare.address, grpc.ssl_channel_credentials(stranger.ca.read_bytes())) as channel:
        code, _ = refusal(lambda: prepare_pb2_grpc.GenerationStub(channel).GetModelInfo(
            prepare_pb2.GetModelInfoRequest(), metadata=bearer(KEY_A), timeout=30))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_the_health_port_is_plaintext_and_serves_health_only(secured):
    pipeline, _, _ = secured
    port = int(pipeline.prepare.port_file.with_suffix(HEALTH_PORT_SUFFIX).read_text())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="stageserve.v1.Generation"), timeout=30)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        code, _ = refusal(lambda: prepare_pb2_grpc.GenerationStub(channel).GetModelInfo(
            prepare_pb2.GetModelInfoRequest(), metadata=bearer(KEY_A), timeout=30))
        assert code == grpc.StatusCode.UNIMPLEMENTED


def test_the_openai_sdk_needs_the_key_over_https(secured):
    pipeline, files, _ = secured
    base_url = f"https://127.0.0.1:{pipeline.prepare.http_port}/v1"

    def sdk(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=httpx.Client(verify=trusting(files.ca)))

    with sdk(KEY_A) as client:
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert answer.usage.completion_tokens == 2
    with sdk("a-wrong-key-0123456789") as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
        assert refused.value.status_code == 401 and "API key" in str(refused.value)
    with httpx.Client(verify=trusting(files.ca)) as http:  # no Authorization header at all (the SDK always sends one)
        refused = http.get(f"{base_url}/models")
        assert refused.status_code == 401 and refused.json()["error"]["message"] == NO_KEY


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def test_the_http_body_and_each_bound_are_refused_before_any_work(secured):
    pipeline, files, _ = secured
    url = f"https://127.0.0.1:{pipeline.prepare.http_port}/v1/completions"
    headers = {"authorization": f"Bearer {KEY_A}"}
    with httpx.Client(verify=trusting(files.ca), timeout=120) as http:
        model = http.get(url.replace("/completions", "/models"), headers=headers).json()["data"][0]["id"]
        big = http.post(url, headers=headers, content=b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}')
        assert big.status_code == 413 and "maximum of 8388608 bytes" in big.json()["error"]["message"]
        stops = http.post(url, headers=headers, json={"model": model, "prompt": "Hi", "stop": ["s"] * 17})
        assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
        assert "maximum of 16" in stops.json()["error"]["message"]
        fine = http.post(url, headers=headers, json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2
