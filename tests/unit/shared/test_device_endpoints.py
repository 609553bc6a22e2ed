"""``--device`` parsing and the DNS re-resolution of :mod:`stageserve.device_endpoints`, with a fake resolver."""

from __future__ import annotations

import argparse
import socket

import pytest

from stageserve.device_endpoints import DeviceEndpoints, EndpointFollower, add_device_arguments, parse_device_endpoints


class FakeResolver:
    """A fake resolver (``socket.getaddrinfo``'s signature, no DNS): answers from :attr:`answers`
    (name -> addresses, or a ``socket.gaierror`` errno to raise) and records the lookups."""

    def __init__(self, **answers) -> None:
        self.answers = answers
        self.lookups: list[tuple[str, int]] = []

    def __call__(self, host, port, type=0):
        self.lookups.append((host, port))
        answer = self.answers.get(host, socket.EAI_NONAME)
        if isinstance(answer, int):
            raise socket.gaierror(answer, "fake lookup failure")
        family = lambda ip: socket.AF_INET6 if ":" in ip else socket.AF_INET  # noqa: E731
        return [(family(ip), socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]


def test_a_list_of_addresses_is_used_as_written():
    endpoints = parse_device_endpoints("10.0.0.2:50052, device-1.local:50052,[::1]:7000,10.0.0.2:50052")
    assert endpoints.entries == ("10.0.0.2:50052", "device-1.local:50052", "[::1]:7000")
    assert endpoints.resolve(FakeResolver()) == ("10.0.0.2:50052", "[::1]:7000", "device-1.local:50052")


def test_a_dns_name_resolves_to_every_address_with_its_port():
    resolver = FakeResolver(**{"device.ns.svc": ["10.1.0.7", "10.1.0.5", "10.1.0.7", "fd00::9"]})
    endpoints = parse_device_endpoints("dns:///device.ns.svc:50052,127.0.0.1:6000")
    assert endpoints.resolve(resolver) == ("10.1.0.5:50052", "10.1.0.7:50052", "127.0.0.1:6000", "[fd00::9]:50052")
    assert resolver.lookups == [("device.ns.svc", 50052)]


@pytest.mark.parametrize("text", ["", "host", "host:", ":50052", "host:0", "host:70000", "a:1,,b:2", "dns:///name", "host:port"])
def test_bad_entries_are_refused_with_the_format(text):
    with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT"):
        parse_device_endpoints(text)


def test_the_cli_flags_parse_into_endpoints():
    parser = argparse.ArgumentParser()
    add_device_arguments(parser, "127.0.0.1:50052")
    defaults = parser.parse_args([])
    assert (defaults.device, defaults.device_refresh_s) == (DeviceEndpoints(("127.0.0.1:50052",)), 10.0)
    args = parser.parse_args(["--device", "dns:///d:1", "--device-refresh-s", "2.5"])
    assert (args.device.entries, args.device_refresh_s) == (("dns:///d:1",), 2.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--device-refresh-s", "0"])


def test_the_follower_tracks_pods_joining_and_leaving_and_keeps_the_set_on_a_dns_outage():
    resolver = FakeResolver(svc=["10.0.0.1"])
    updates: list[tuple[str, ...]] = []
    follower = EndpointFollower(parse_device_endpoints("dns:///svc:50052"), 3600, updates.append, resolver)
    follower.start()  # the first lookup happens on the caller's thread
    try:
        resolver.answers["svc"] = ["10.0.0.2", "10.0.0.1"]  # a pod became ready
        follower.refresh()
        resolver.answers["svc"] = socket.EAI_AGAIN  # the DNS server timed out: keep what we had
        follower.refresh()
        resolver.answers["svc"] = ["10.0.0.2"]  # a pod is draining (not ready: left the answer)
        follower.refresh()
        resolver.answers["svc"] = socket.EAI_NONAME  # no ready pod at all
        follower.refresh()
    finally:
        follower.stop()
    assert updates == [("10.0.0.1:50052",), ("10.0.0.1:50052", "10.0.0.2:50052"), ("10.0.0.1:50052", "10.0.0.2:50052"),
                       ("10.0.0.2:50052",), ()]


def test_the_follower_reports_nothing_until_a_first_lookup_succeeds():
    resolver = FakeResolver(svc=socket.EAI_AGAIN)
    updates: list[tuple[str, ...]] = []
    follower = EndpointFollower(parse_device_endpoints("dns:///svc:1"), 3600, updates.append, resolver)
    follower.refresh()
    resolver.answers["svc"] = ["10.0.0.3"]
    follower.refresh()
    assert updates == [("10.0.0.3:1",)]
