"""Admission in API keys' turns (``waiting_queues.py``) and the keys' limits: one key's burst does
not delay another key's first admission; ``max_running`` and ``max_waiting`` hold per key."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from stageserve.prepare.errors import RequestError
from stageserve.security.keys import TenantLimits

from .test_scheduler import make_request, make_scheduler


def of(tenant: str, request_id: str, limits: TenantLimits = TenantLimits()):
    return replace(make_request(request_id, 4, 4), tenant=tenant, tenant_limits=limits)


def started(step) -> list[str]:
    return [seq.request.request_id for seq in step.started]


def test_keys_take_turns_where_one_key_came_first_with_a_burst():
    scheduler = make_scheduler(max_num_seqs=4, max_waiting=16)
    for i in range(6):
        scheduler.add_request(of("team-a", f"a{i}"))
    scheduler.add_request(of("team-b", "b0"))
    scheduler.add_request(of("team-c", "c0"))
    assert started(scheduler.schedule()) == ["a0", "b0", "c0", "a1"]


def test_a_weight_gives_a_key_that_many_admissions_a_turn():
    scheduler = make_scheduler(max_num_seqs=6, max_waiting=16, max_step_tokens=32)
    for i in range(4):
        scheduler.add_request(of("team-a", f"a{i}", TenantLimits(weight=2)))
        scheduler.add_request(of("team-b", f"b{i}"))
    assert started(scheduler.schedule()) == ["a0", "a1", "b0", "a2", "a3", "b1"]


def test_a_key_at_its_max_running_is_passed_over_and_others_are_admitted():
    scheduler = make_scheduler(max_num_seqs=4, max_waiting=16)
    limited = TenantLimits(max_running=1)
    for i in range(3):
        scheduler.add_request(of("team-a", f"a{i}", limited))
    scheduler.add_request(of("team-b", "b0"))
    scheduler.add_request(of("team-b", "b1"))
    assert started(scheduler.schedule()) == ["a0", "b0", "b1"]
    assert scheduler.num_waiting == 2 and started(scheduler.schedule()) == []  # a1, a2 wait for a0's end


def test_a_key_past_its_max_waiting_is_refused_with_a_retry_and_another_key_is_not():
    scheduler = make_scheduler(max_num_seqs=2, max_waiting=16)
    limited = TenantLimits(max_running=1, max_waiting=2)
    for i in range(3):  # one the next step admits, two waiting
        scheduler.add_request(of("team-a", f"a{i}", limited))
    with pytest.raises(RequestError) as refused:
        scheduler.add_request(of("team-a", "a3", limited))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s
    assert "'team-a' has 2 requests waiting, its maximum" in refused.value.message
    scheduler.add_request(of("team-b", "b0"))
