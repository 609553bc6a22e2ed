"""``stageserve.security`` on in-process servers (the shared :class:`ServiceServer` classes): API
keys, the guard's access classes and malformed requests, TLS and mutual TLS from files made with
``cryptography``, certificate rotation, and the plaintext health-only port."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.security.config import ServiceSecurity
from stageserve.security.guard import BAD_KEY, NO_KEY, AccessPolicy
from stageserve.security.keys import KeyRing, Principal, TenantLimits
from stageserve.security.tls import dial
from stageserve.server import AioServiceServer, ServiceServer
from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2, admin_pb2_grpc
from tests.security_certs import Authority

KEY_A = "key-of-team-a-0123456789"
ADMIN_KEY = "key-of-the-operators-0123"
NAME = "stageserve.v1.Test"


@pytest.fixture
def keys_files(tmp_path) -> tuple[Path, Path]:
    api = tmp_path / "api-keys"
    api.write_text(f"# a comment\n\n{KEY_A} team-a\nsha256:{hashlib.sha256(b'hashed-key-0123456789').hexdigest()}\n")
    admin = tmp_path / "admin-keys"
    admin.write_text(f"{ADMIN_KEY} ops\n")
    return api, admin


def test_keys_are_kept_as_hashes_and_looked_up_by_hash(keys_files):
    ring = KeyRing.from_files(*keys_files)
    digest = hashlib.sha256(b"hashed-key-0123456789").hexdigest()
    assert ring.lookup(KEY_A) == Principal("team-a") and ring.lookup(ADMIN_KEY) == Principal("ops", admin=True)
    assert ring.lookup("hashed-key-0123456789") == Principal(f"key-{digest[:8]}")
    assert ring.lookup("not-a-key-at-all-xxxx") is None and ring.lookup("") is None
    assert KEY_A not in repr(ring.__dict__)  # only digests are kept


def test_a_keys_line_may_give_the_keys_limits_after_its_name(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A} team-a max_running=4 weight=2\nkey-of-team-b-0123456789 team-b\n")
    ring = KeyRing.from_files(path)
    assert ring.lookup(KEY_A).limits == TenantLimits(weight=2, max_running=4)
    assert ring.limits() == {"team-a": TenantLimits(weight=2, max_running=4), "team-b": TenantLimits()}


@pytest.mark.parametrize(("text", "expected"), [
    ("short\n", "at least 16 characters"),
    ("a-long-enough-key-0123 bad/name\n", "may hold only letters"),
    ("one two three four five six\n", "expected a key or sha256:HEX"),
    ("a-long-enough-key-0123 team-a three\n", "'three' is not a limit"),
    ("a-long-enough-key-0123 team-a max_running=0\n", "max_running must be a positive integer"),
    ("# only a comment\n", "holds no key"),
])
def test_a_bad_keys_file_is_refused_naming_the_flag_and_line_not_the_key(tmp_path, text, expected):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        KeyRing.from_files(path)
    assert expected in str(error.value) and "--api-keys-file" in str(error.value) and "short" not in str(error.value).split(":", 1)[1]


def serve(tmp_path: Path, server_class=AioServiceServer, **security) -> ServiceServer:
    server = server_class(NAME, "127.0.0.1", 0, tracer=Tracer("test"), profile_dir=tmp_path / "profiles",
                          security=ServiceSecurity(**security), **({"thread_name": "test-security"} if server_class is AioServiceServer else {}))
    server.start([NAME])
    return server


def stop_profile(channel: grpc.Channel, key: str | None) -> grpc.StatusCode:
    metadata = [("authorization", f"Bearer {key}")] if key else None
    try:
        admin_pb2_grpc.AdminStub(channel).StopProfile(admin_pb2.StopProfileRequest(), metadata=metadata, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()


@pytest.mark.parametrize("server_class", [AioServiceServer, ServiceServer])
def test_admin_needs_an_admin_key_and_health_stays_open(tmp_path, keys_files, server_class):
    server = serve(tmp_path, server_class, policy=AccessPolicy(KeyRing.from_files(*keys_files)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            # FAILED_PRECONDITION (nothing is recording) means the call got through
            assert [stop_profile(channel, key) for key in (None, "wrong-key-0123456789", KEY_A, ADMIN_KEY)] == [
                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.FAILED_PRECONDITION]
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_closed_health_needs_a_key(tmp_path, keys_files):
    server = serve(tmp_path, policy=AccessPolicy(KeyRing.from_files(*keys_files), open_health=False))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            with pytest.raises(grpc.RpcError) as refused:
                check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, NO_KEY)
            with pytest.raises(grpc.RpcError) as refused:
                check(health_pb2.HealthCheckRequest(service=""), metadata=[("authorization", "Bearer nope-nope-nope-nope")], timeout=10)
            assert refused.value.details() == BAD_KEY
            assert check(health_pb2.HealthCheckRequest(service=""), metadata=[("authorization", f"bearer {KEY_A}")], timeout=10).status
    finally:
        server.stop(0)


@pytest.mark.parametrize("server_class", [AioServiceServer, ServiceServer])
def test_undecodable_requests_are_invalid_argument(tmp_path, server_class):
    server = serve(tmp_path, server_class)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # no serializers: raw bytes
            for call in (lambda: channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff", timeout=10),
                         lambda: list(channel.unary_stream("/grpc.health.v1.Health/Watch")(b"\x0a\xff", timeout=10)),
                         lambda: list(channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
                             iter([b"\xff\xff"]), timeout=10))):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
                assert "does not decode as its protobuf type" in refused.value.details()
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    finally:
        server.stop(0)


def check(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def test_mutual_tls_refuses_callers_without_a_trusted_client_certificate(tmp_path):
    ca, other = Authority.create("stageserve test CA"), Authority.create("another CA")
    files, stranger = ca.issue(tmp_path / "ca", "device"), other.issue(tmp_path / "other", "stranger")
    server = serve(tmp_path, ServiceServer, tls=files, require_client_cert=True, policy=AccessPolicy(peer_certificates=True), health_port=0)
    target, ca_pem = f"127.0.0.1:{server.port}", files.ca.read_bytes()
    try:
        assert check(target, files.channel_credentials()) == grpc.StatusCode.OK  # a peer with a certificate of the CA
        assert check(target, grpc.ssl_channel_credentials(ca_pem)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert check(target, grpc.ssl_channel_credentials(ca_pem, stranger.key.read_bytes(), stranger.cert.read_bytes())) == \
            grpc.StatusCode.UNAVAILABLE  # a certificate of another CA
        assert check(target, stranger.channel_credentials()) == grpc.StatusCode.UNAVAILABLE  # the server is not of the client's CA
        assert check(target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        # --tls-server-name: the name checked in the server's certificate (FAILED_PRECONDITION: the call got through)
        for name, expected in (("localhost", grpc.StatusCode.FAILED_PRECONDITION), ("not-in-the-certificate", grpc.StatusCode.UNAVAILABLE)):
            with dial(target, replace(files, server_name=name)) as channel:
                assert stop_profile(channel, None) == expected
        # The health-only port: plaintext, health and nothing else.
        assert check(f"127.0.0.1:{server.health_port}", None) == grpc.StatusCode.OK
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            assert stop_profile(channel, None) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    first, second = Authority.create("first CA"), Authority.create("second CA")
    files = first.issue(tmp_path / "tls", "prepare")
    server = serve(tmp_path, tls=files)
    target = f"127.0.0.1:{server.port}"
    try:
        assert check(target, grpc.ssl_channel_credentials(files.ca.read_bytes())) == grpc.StatusCode.OK
        renewed = second.issue(tmp_path / "renewed", "prepare")
        for source, target_path in ((renewed.cert, files.cert), (renewed.key, files.key)):
            target_path.write_bytes(source.read_bytes())  # what a Secret update does to the mounted files
        assert check(target, grpc.ssl_channel_credentials(renewed.ca.read_bytes())) == grpc.StatusCode.OK
        assert check(target, grpc.ssl_channel_credentials(files.ca.read_bytes())) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
