"""TLS and mutual TLS from PEM files: the flags, the server credentials, the internal channels.

The three services take the same flags (:func:`stageserve.security.config.add_security_arguments`):

- ``--tls-cert`` / ``--tls-key``: the service's certificate chain and private key. Its listener
  serves TLS with them, and its internal channels (prepare → device/reclaim, reclaim → device)
  present them as the client certificate.
- ``--tls-ca``: the CA bundle the service trusts. It verifies the servers the internal channels
  dial, and the client certificates of callers: a service that serves internal RPCs (device,
  reclaim) *requires* a client certificate from it on every connection. prepare's public listener
  asks none (public clients authenticate with API keys).
- ``--tls-server-name``: the name internal channels expect in the peers' certificates instead of
  the host they dial. Devices found through a ``dns:///`` entry are dialled by pod IP, which no
  certificate names: give every internal certificate one common name (a SAN) and this flag.

Server credentials re-read the three files when one of them changes (checked at each new
connection, through ``grpc.dynamic_ssl_server_credentials``), so a renewed certificate (e.g. a
Secret updated by cert-manager) is served without a restart; connections already open keep the old
one. A half-written file (unreadable or not PEM) is skipped with a warning and the old
certificate stays. Channels read the files when they are created, i.e. at each (re)connect.
"""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one service (see the module docstring).

    Attributes:
        cert, key: the service's certificate chain and key; ``None`` for a service that only dials.
        ca: the trusted CA bundle; ``None``: no peer is verified (and internal channels stay plaintext).
        server_name: the name the peers' certificates must hold; ``None``: the dialled host.
    """

    cert: Path | None
    key: Path | None
    ca: Path | None
    server_name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, serves_internal: bool) -> "TlsFiles | None":
        """The files the flags name, ``None`` for plaintext (no flag given).

        Args:
            serves_internal: the service serves internal RPCs (device, reclaim): TLS then needs
                ``--tls-ca``, since every caller must present a certificate of that CA.

        Raises:
            ValueError: ``--tls-cert`` without ``--tls-key`` (or the other way round), a missing
                file, or ``--tls-cert`` without ``--tls-ca`` where ``serves_internal``.
        """
        cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
        if cert is None and key is None and ca is None:
            if args.tls_server_name:
                raise ValueError("--tls-server-name needs --tls-ca (and --tls-cert/--tls-key)")
            return None
        if (cert is None) != (key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both (or neither, for plaintext)")
        if serves_internal and cert is not None and ca is None:
            raise ValueError("--tls-cert needs --tls-ca here: this service accepts internal RPCs only from peers with a"
                             " client certificate of that CA")
        for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag} {path}: no such file")
        return cls(cert, key, ca, args.tls_server_name or None)

    @property
    def serves_tls(self) -> bool:
        """Whether a listener with these files speaks TLS (a certificate is given)."""
        return self.cert is not None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials of a listener, re-reading the files when they change.

        Args:
            require_client_cert: every connection must present a client certificate signed by
                ``ca`` (mutual TLS); else none is asked.

        Raises:
            ValueError: a file is not readable PEM (at start-up; later changes are only logged).
        """
        if self.cert is None or self.key is None:
            raise ValueError("--tls-cert and --tls-key are needed to serve TLS")
        reloader = _CertificateReloader(self, require_client_cert)
        return grpc.dynamic_ssl_server_credentials(reloader.initial(), reloader.fetch,
                                                   require_client_authentication=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of an internal channel: verify the server by ``ca``; present ``cert`` when given."""
        key_pair = (self.key.read_bytes(), self.cert.read_bytes()) if self.cert is not None and self.key is not None else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes() if self.ca else None,
                                            private_key=key_pair[0], certificate_chain=key_pair[1])

    def describe(self, require_client_cert: bool) -> str:
        """For the start-up log: what the listener serves."""
        return f"TLS ({self.cert}{', client certificates required from ' + str(self.ca) if require_client_cert else ''})"


def dial(target: str, tls: TlsFiles | None, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A channel to an internal peer: TLS when ``tls`` has a CA (with the client certificate if any), else plaintext."""
    if tls is None or tls.ca is None:
        return grpc.insecure_channel(target, options=options)
    name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(target, tls.channel_credentials(), options=[*(options or []), *name])


class _CertificateReloader:
    """The certificate configuration fetcher of ``grpc.dynamic_ssl_server_credentials``: a new
    configuration when a file's modification time or size changed, else ``None`` (unchanged)."""

    def __init__(self, files: TlsFiles, require_client_cert: bool) -> None:
        self._files = files
        self._require = require_client_cert
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()

    def initial(self) -> grpc.ServerCertificateConfiguration:
        """The configuration to start with. Raises ValueError: the files cannot be read or used."""
        try:
            return self._configuration()
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tls-cert/--tls-key/--tls-ca: cannot use them ({exc})") from exc

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher, called per handshake: a new configuration when the files changed, else ``None`` (keep)."""
        with self._lock:
            stamp = self._read_stamp()
            if stamp == self._stamp:
                return None
            try:
                configuration = self._configuration()
            except (OSError, ValueError) as exc:
                log.warning("TLS files changed but cannot be used yet (%s); serving the previous certificate", exc)
                return None
            self._stamp = stamp
            log.info("TLS files changed: serving the new certificate to new connections")
            return configuration

    def _paths(self) -> list[Path]:
        return [path for path in (self._files.cert, self._files.key, self._files.ca) if path is not None]

    def _read_stamp(self) -> tuple:
        stamp = []
        for path in self._paths():
            try:
                status = path.stat()
                stamp.append((status.st_mtime_ns, status.st_size))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self._files.cert.read_bytes(), self._files.key.read_bytes()
        if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
            raise ValueError("not PEM")
        ca = self._files.ca.read_bytes() if self._files.ca is not None and self._require else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
