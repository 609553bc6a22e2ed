"""EarlyAborts: an abort for an unknown id is kept for its caller, for ttl seconds, used once."""

from stageserve.prepare.early_aborts import EarlyAborts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_early_abort_is_taken_once_by_its_caller_within_the_ttl():
    clock = Clock()
    aborts = EarlyAborts(ttl_s=10, clock=clock)
    aborts.remember("ipv4:10.0.0.1", "r1")
    assert not aborts.take("ipv4:10.0.0.2", "r1")  # another caller's request of the same id is not touched
    clock.now += 9.9
    assert aborts.take("ipv4:10.0.0.1", "r1")
    assert not aborts.take("ipv4:10.0.0.1", "r1")  # used up


def test_early_aborts_expire_and_are_bounded():
    clock = Clock()
    aborts = EarlyAborts(ttl_s=10, max_entries=3, clock=clock)
    for request_id in "abcd":
        aborts.remember("c", request_id)
    assert len(aborts) == 3 and not aborts.take("c", "a")  # the oldest went first
    clock.now += 10
    assert len(aborts) == 0 and not aborts.take("c", "d")


def test_a_late_abort_does_not_end_the_next_request_of_that_id():
    aborts = EarlyAborts(ttl_s=10, clock=Clock())
    assert not aborts.take("c", "r1")  # r1 registers, runs, finishes
    aborts.remember("c", "r1")         # an Abort after it finished (idempotent): not kept
    assert not aborts.take("c", "r1")  # the id reused at once runs
