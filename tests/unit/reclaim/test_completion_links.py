"""reclaim's set of completion links following ``--device`` through DNS (a fake resolver), with stand-in links."""

from __future__ import annotations

import socket

from stageserve.device_endpoints import parse_device_endpoints
from stageserve.reclaim.links import CompletionLinks


class FakeDns:
    """A fake resolver (``socket.getaddrinfo``'s signature, no DNS) answering from :attr:`answers`."""

    def __init__(self, **answers: list[str]) -> None:
        self.answers = answers

    def __call__(self, host, port, type=0):
        if not self.answers.get(host):
            raise socket.gaierror(socket.EAI_NONAME, "fake: no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in self.answers[host]]


class StandInLink:
    """Records what CompletionLinks asks of a link; the test decides when its thread 'ends'."""

    def __init__(self, address: str, set_attached) -> None:
        self.address, self.set_attached = address, set_attached
        self.listed, self.finished, self.started, self.stopped = True, False, False, False
        self.live = 0

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def set_listed(self, listed: bool) -> None:
        self.listed = listed

    def wait_idle(self, timeout_s: float) -> bool:
        return self.live == 0


def test_links_follow_the_dns_answer_and_readiness_needs_one_attached_device():
    dns = FakeDns(svc=["10.0.0.1"])
    made: list[StandInLink] = []
    ready: list[bool] = []

    def new_link(address: str, set_attached) -> StandInLink:
        made.append(StandInLink(address, set_attached))
        return made[-1]

    links = CompletionLinks(parse_device_endpoints("dns:///svc:50052"), 3600, new_link, ready.append, dns)
    links.start()
    try:
        first = made[0]
        assert (first.address, first.started) == ("10.0.0.1:50052", True)
        first.set_attached(True)
        dns.answers["svc"] = ["10.0.0.1", "10.0.0.2"]  # a pod joined
        links._follower.refresh()
        second = made[1]
        assert second.address == "10.0.0.2:50052" and second.started
        second.set_attached(True)
        first.live, second.live = 2, 3
        assert links.live == 5 and not links.wait_idle(0)

        dns.answers["svc"] = ["10.0.0.2"]  # the first is draining: it keeps its stream, is not re-dialled
        links._follower.refresh()
        assert not first.listed and not first.stopped and second.listed
        first.live = 0
        first.set_attached(False)  # its stream ended; its thread ends
        first.finished = True
        links._follower.refresh()
        assert first.stopped and links.live == 3

        dns.answers["svc"] = ["10.0.0.1", "10.0.0.2"]  # a new pod took the address: a new link
        links._follower.refresh()
        assert len(made) == 3 and made[2].address == "10.0.0.1:50052" and made[2].started
        second.set_attached(False)
        assert ready == [True, False]  # ready while at least one device was attached
    finally:
        links.stop()
    assert all(link.stopped for link in made)
