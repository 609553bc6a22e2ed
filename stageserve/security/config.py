"""The security flags every service shares, and what they make: a :class:`ServiceSecurity`.

Defined once (:func:`add_security_arguments`), parsed once (:meth:`ServiceSecurity.from_args`):
TLS files (``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--tls-server-name``), the plaintext health-only port
(``--health-port``) and whether health and reflection stay open (``--[no-]open-health``,
``--[no-]open-reflection``). prepare adds its API keys (``--api-keys-file``, ``--admin-keys-file``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from stageserve.security.guard import AccessPolicy
from stageserve.security.keys import KeyRing
from stageserve.security.tls import TlsFiles


def add_security_arguments(parser: argparse.ArgumentParser, port_type) -> None:
    """Add the shared security flags to ``parser``; ``port_type`` parses a port number."""
    group = parser.add_argument_group("security (default: plaintext, no keys: local development)")
    group.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                       help="serve TLS with this certificate chain; internal channels present it as their client certificate")
    group.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    group.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                       help="CA bundle trusted for the peers: verifies the servers dialled and, on device and reclaim,"
                            " the client certificate every caller must present (mutual TLS)")
    group.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="the name internal channels expect in the peers' certificates instead of the dialled host"
                            " (devices of a dns:/// entry are dialled by IP; default: the dialled host)")
    group.add_argument("--health-port", type=port_type, default=None, metavar="PORT",
                       help="also serve grpc.health.v1.Health alone, plaintext, on this port (Kubernetes gRPC probes"
                            " cannot do TLS); 0 = ephemeral, written to <port-file>.health-port (default: off)")
    group.add_argument("--open-health", action=argparse.BooleanOptionalAction, default=True,
                       help="health needs no API key (default: open; on a mutual-TLS listener the handshake still needs a"
                            " certificate: probe --health-port)")
    group.add_argument("--open-reflection", action=argparse.BooleanOptionalAction, default=True,
                       help="server reflection needs no API key (default: open)")


def add_key_arguments(parser: argparse.ArgumentParser) -> None:
    """prepare's API key flags."""
    group = parser.add_argument_group("API keys (default: none, the public API is open)")
    group.add_argument("--api-keys-file", type=Path, default=None, metavar="PATH",
                       help="keys of the public API, one per line (raw, or sha256:HEX), optionally followed by a name;"
                            " callers send 'authorization: Bearer KEY'")
    group.add_argument("--admin-keys-file", type=Path, default=None, metavar="PATH",
                       help="keys that may also call stageserve.v1.Admin (same format)")


@dataclass(frozen=True)
class ServiceSecurity:
    """What one service's listeners and channels need.

    Attributes:
        tls: the TLS files, ``None`` for plaintext.
        require_client_cert: the listener requires a client certificate of ``tls.ca`` (device, reclaim).
        policy: the access policy its interceptor applies.
        health_port: the plaintext health-only port, ``None`` for none.
    """

    tls: TlsFiles | None = None
    require_client_cert: bool = False
    policy: AccessPolicy = field(default_factory=AccessPolicy)
    health_port: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, serves_internal: bool) -> "ServiceSecurity":
        """The flags' security. ``serves_internal``: device and reclaim (mutual TLS required when TLS is on).

        Raises:
            ValueError: inconsistent TLS flags, or a keys file that cannot be used (the message names the flag).
        """
        tls = TlsFiles.from_args(args, serves_internal)
        keys = KeyRing.from_files(getattr(args, "api_keys_file", None), getattr(args, "admin_keys_file", None))
        require = serves_internal and tls is not None and tls.serves_tls
        policy = AccessPolicy(keys, peer_certificates=require, open_health=args.open_health, open_reflection=args.open_reflection)
        return cls(tls, require, policy, args.health_port)

    def describe(self) -> str:
        """For the start-up log: the transport and what callers need."""
        transport = self.tls.describe(self.require_client_cert) if self.tls is not None and self.tls.serves_tls else "plaintext"
        keys = f", {len(self.policy.keys)} API key(s)" if self.policy.keys else ""
        return transport + keys
