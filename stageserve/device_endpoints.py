"""Which device services prepare and reclaim talk to: the ``--device`` flag and its re-resolution.

``--device`` is a comma-separated list of entries, each either

- ``HOST:PORT`` (``[IPV6]:PORT`` for an IPv6 literal): one device, dialled as written; or
- ``dns:///NAME:PORT``: every address ``NAME`` resolves to, one device each. A Kubernetes
  headless Service resolves to its **ready** pods, so pods that start, drain or die join and leave
  the answer.

:class:`EndpointFollower` resolves the entries every ``--device-refresh-s`` seconds and hands the
current address set to its consumer (prepare's device sessions, reclaim's completion links), which opens a
connection to a new address and stops using one that left. A name that does not resolve
(``EAI_NONAME``: a headless Service with no ready pod) contributes no address; any other lookup
failure (a DNS server timeout) keeps the previous set, so a DNS hiccup never drops a device.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
DEFAULT_REFRESH_S = 10.0
# getaddrinfo's "this name has no address": the headless Service has no ready pod (or the name is wrong).
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

Resolver = Callable[..., list]  # socket.getaddrinfo's signature and result


@dataclass(frozen=True)
class DeviceEndpoints:
    """The parsed ``--device`` flag.

    Attributes:
        entries: the entries as written, in order (``HOST:PORT`` or ``dns:///NAME:PORT``).
    """

    entries: tuple[str, ...]

    def resolve(self, resolver: Resolver = socket.getaddrinfo) -> tuple[str, ...]:
        """The device addresses (``HOST:PORT``) the entries name now, sorted, without duplicates.

        Raises:
            OSError: a ``dns:///`` name could not be looked up for a reason other than "no such
                name" (``socket.gaierror``, e.g. ``EAI_AGAIN``); the caller keeps its previous set.
        """
        addresses: set[str] = set()
        for entry in self.entries:
            if not entry.startswith(DNS_SCHEME):
                addresses.add(entry)
                continue
            name, port = split_host_port(entry[len(DNS_SCHEME):])
            try:
                infos = resolver(name, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                if exc.errno in _NO_ADDRESS:
                    continue
                raise
            addresses.update(_join_host_port(info[4][0], port) for info in infos)
        return tuple(sorted(addresses))


def parse_device_endpoints(text: str) -> DeviceEndpoints:
    """Parse ``--device`` (the argparse ``type``): comma-separated ``HOST:PORT`` / ``dns:///NAME:PORT``.

    Raises:
        argparse.ArgumentTypeError: an empty list, or an entry without a host or a port in 1..65535.
    """
    entries = tuple(entry.strip() for entry in text.split(","))
    if not text.strip() or not all(entries):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more HOST:PORT or dns:///NAME:PORT entries, separated by commas")
    for entry in entries:
        try:
            split_host_port(entry.removeprefix(DNS_SCHEME))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"device entry {entry!r}: {exc}") from None
    return DeviceEndpoints(tuple(dict.fromkeys(entries)))


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:50052"`` → ``("host", 50052)``; ``"[::1]:50052"`` → ``("::1", 50052)``.

    Raises:
        ValueError: no host, or no port in 1..65535.
    """
    host, colon, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError("write it as HOST:PORT with a port in 1..65535 (an IPv6 host in brackets: [::1]:50052)")
    return host, int(port_text)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointFollower:
    """Resolves ``endpoints`` now and every ``refresh_s`` seconds on a thread and calls
    ``on_update(addresses)`` with the current set each time (also when unchanged, so the consumer
    can tidy up connections that ended).

    Args:
        endpoints: the parsed ``--device``.
        refresh_s: seconds between lookups (``--device-refresh-s``).
        on_update: gets the sorted address tuple; called on the follower's thread, never concurrently.
        resolver: ``socket.getaddrinfo`` or a stand-in with its signature (tests).
    """

    def __init__(self, endpoints: DeviceEndpoints, refresh_s: float, on_update: Callable[[tuple[str, ...]], None],
                 resolver: Resolver = socket.getaddrinfo) -> None:
        self._endpoints, self._refresh_s = endpoints, refresh_s
        self._on_update, self._resolver = on_update, resolver
        self._current: tuple[str, ...] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-endpoints", daemon=True)

    def start(self) -> None:
        """Resolve once on the caller's thread (so the first devices are known at once), then follow."""
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def refresh(self) -> None:
        """Resolve now and report the set (the previous one when the lookup failed)."""
        try:
            addresses = self._endpoints.resolve(self._resolver)
        except OSError as exc:
            log.warning("cannot resolve the device endpoints %s (%s); keeping %s", ",".join(self._endpoints.entries), exc,
                        ",".join(self._current or ()) or "none")
            if self._current is None:
                return
            addresses = self._current
        if addresses != self._current:
            log.info("device endpoints: %s", ", ".join(addresses) or "none")
            self._current = addresses
        self._on_update(addresses)

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self.refresh()


def add_device_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """``--device`` and ``--device-refresh-s``, the same for prepare and reclaim."""
    parser.add_argument("--device", type=parse_device_endpoints, default=parse_device_endpoints(default),
                        metavar="HOST:PORT,...|dns:///NAME:PORT",
                        help="the device services: comma-separated HOST:PORT entries, or dns:///NAME:PORT for every address NAME "
                             "resolves to (a Kubernetes headless Service), re-resolved every --device-refresh-s (default: %s)" % default)
    parser.add_argument("--device-refresh-s", type=_positive_float, default=DEFAULT_REFRESH_S, metavar="SECONDS",
                        help="seconds between DNS lookups of dns:/// device entries (default %(default)s)")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value
