"""The draft planner: each decode row's drafts chosen by expected tokens per second, from the
sequences' acceptance and the device's measured step costs (no gRPC, no device)."""

from __future__ import annotations

import pytest

from stageserve.prepare.draft_planner import FIRST_PROBE_ROWS, RunEstimate, DraftPlanner, SequenceDrafts, StepCostModel
from stageserve.prepare.scheduler_config import SchedulerConfig
from stageserve.v1 import device_pb2

from .test_scheduler import event, make_request, make_scheduler, publish

K = 3


def cost_model(seconds) -> StepCostModel:
    """``seconds(rows, drafts)`` tabled at 1, 2, 4, 8 rows and 0..K drafts per row."""
    return StepCostModel([device_pb2.StepCost(rows=r, drafts=k, seconds=seconds(r, k)) for r in (1, 2, 4, 8) for k in range(K + 1)])


FLAT = cost_model(lambda rows, drafts: 0.010)  # bound by the weight stream: entries are free
STEEP = cost_model(lambda rows, drafts: 0.010 * rows * (1 + 0.5 * drafts))  # each draft costs half a row
MILD = cost_model(lambda rows, drafts: 0.010 * rows * (1 + 0.1 * drafts))


def sequence(rate: float) -> SequenceDrafts:
    """A sequence whose estimate has seen many rows, each draft accepted with probability ``rate``
    after the ones before it."""
    return SequenceDrafts(K, RunEstimate([100 * rate ** (j + 1) for j in range(K)], [100 * rate ** j for j in range(K)], 0.9))


def test_the_cost_model_is_monotone_interpolates_between_rows_and_extrapolates_past_them():
    noisy = StepCostModel([device_pb2.StepCost(rows=r, drafts=k, seconds=s) for r, k, s in
                           [(1, 0, 1.0), (1, 1, 0.9), (4, 0, 2.0), (4, 1, 4.0)]])
    assert noisy.seconds == [[1.0, 1.0], [2.0, 4.0]]  # the dip at (1, 1) raised to (1, 0)
    assert noisy.seconds_by_drafts(2, 0) == pytest.approx([4 / 3, 2.0])
    assert noisy.seconds_by_drafts(8, 0) == [4.0, 8.0]
    assert noisy.step_seconds(noisy.seconds_by_drafts(4, 0), 4, 2) == pytest.approx(3.0)  # half a draft per row
    assert noisy.per_row == noisy.per_entry == 0  # no line at a longer context


def test_the_context_adds_a_cost_per_row_and_per_entry_fitted_to_the_long_context_line():
    def seconds(rows, drafts, context):
        return 0.010 * rows * (1 + 0.2 * drafts) + context * rows * (2e-6 + 1e-6 * (1 + drafts))

    costs = [device_pb2.StepCost(rows=r, drafts=k, context_tokens=8, seconds=seconds(r, k, 8)) for r in (1, 8) for k in range(K + 1)]
    costs += [device_pb2.StepCost(rows=8, drafts=k, context_tokens=256, seconds=seconds(8, k, 256)) for k in range(K + 1)]
    reply = device_pb2.AttachReply(num_speculative_tokens=K, step_costs=costs)
    model = StepCostModel.from_attach(reply)
    assert (model.per_row, model.per_entry) == (pytest.approx(2e-6), pytest.approx(1e-6))
    assert SchedulerConfig.from_attach(reply, max_prefill_chunk=8, max_waiting=8).step_costs.per_entry == model.per_entry
    assert model.seconds_by_drafts(4, 108) == pytest.approx([seconds(4, k, 108) for k in range(K + 1)])
    reply = device_pb2.AttachReply(step_costs=[device_pb2.StepCost(rows=1, drafts=1, seconds=1.0)])
    assert StepCostModel.from_attach(reply) is None  # no 0-draft measurement: not a table
    assert StepCostModel.from_attach(device_pb2.AttachReply()) is None


def test_where_entries_are_free_every_accepting_row_drafts_fully():
    planner = DraftPlanner(K, FLAT)
    assert planner.plan([(sequence(0.6), K), (sequence(0.3), K)], spare=100) == [K, K]


def test_where_drafts_are_dear_only_rows_that_are_usually_accepted_draft():
    planner = DraftPlanner(K, STEEP)
    assert planner.plan([(sequence(0.9), K), (sequence(0.1), K), (sequence(0.9), K)], spare=100) == [K, 0, K]
    assert planner.plan([(sequence(0.1), K)], spare=100) == [0]


def test_caps_the_budget_and_sampling_that_forbids_drafts_are_kept():
    planner = DraftPlanner(K, FLAT)
    forbidden = SequenceDrafts(0)
    assert planner.plan([(sequence(0.9), 1), (forbidden, K), (sequence(0.9), K)], spare=2) == [1, 0, 1]
    assert DraftPlanner(K, None).plan([(sequence(0.0), K), (sequence(0.0), 2)], spare=4) == [K, 1]  # without costs: in order, all asked


def test_a_sequence_that_does_not_draft_probes_with_one_draft_and_then_waits_twice_as_long():
    planner = DraftPlanner(K, STEEP)
    state = sequence(0.05)
    planned = [planner.plan([(state, K)], spare=100)[0] for _ in range(FIRST_PROBE_ROWS + 1 + 2 * FIRST_PROBE_ROWS + 1)]
    assert planned.index(1) == FIRST_PROBE_ROWS and planned.count(1) == 2
    assert planned[-1] == 1 and sum(planned) == 2  # the second probe after twice the rows


def test_accepted_drafts_raise_the_estimate_and_rejected_ones_lower_it():
    planner = DraftPlanner(K, STEEP)
    state = SequenceDrafts(K)
    for _ in range(20):
        planner.observe(state, K, K, 0)
    assert state.acceptance.reach()[0] < 0.1 and planner.plan([(state, K)], spare=100) == [0]
    assert state.acceptance.trials[1] == 0  # no row got past its first draft
    for _ in range(20):
        planner.observe(state, K, K, K)
    assert min(state.acceptance.reach()) > 0.7 and planner.plan([(state, K)], spare=100) == [K]
    assert 0.1 < planner.acceptance.rates()[0] < 0.9  # the scheduler-wide prior remembers both
    trials = list(state.acceptance.trials)
    planner.observe(state, 1, 1, 0)  # a row asking for one draft says nothing of the second
    assert state.acceptance.trials[1:] == trials[1:]


def test_a_position_a_sequence_never_reached_takes_the_scheduler_wide_estimate():
    planner = DraftPlanner(K, MILD)
    others = SequenceDrafts(K)
    for _ in range(30):  # other sequences: a run, once started, goes on
        planner.observe(others, K, K, K)
    state = SequenceDrafts(K)
    for _ in range(10):  # this one: asks for one draft, accepted one time in three
        planner.observe(state, 1, 1, 0)
        planner.observe(state, 1, 1, 0)
        planner.observe(state, 1, 1, 1)
    rates = state.acceptance.rates(planner.acceptance.rates())
    assert rates[0] < 0.5 and rates[1] > 0.9 and rates[2] > 0.9  # the later positions from the others
    assert planner.plan([(state, K)], spare=100) == [K]
    alone = RunEstimate.empty(K)
    for _ in range(10):  # without a prior: a position never reached takes the one before
        alone.observe(2, 2)
    assert alone.rates()[2] == alone.rates()[1] > 0.8


def test_the_scheduler_plans_drafts_from_published_acceptance():
    scheduler = make_scheduler(num_speculative_tokens=K, max_step_tokens=32, step_costs=MILD)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=200))
    publish(scheduler, prefill := scheduler.schedule(), event(prefill, "a", tokens=[7]))
    asked = []
    for _ in range(12):  # every draft rejected
        step = scheduler.schedule()
        asked.append(step.num_draft_tokens[0])
        publish(scheduler, step, event(step, "a", tokens=[8]))
    assert asked[0] > 0 and asked[-1] == 0  # the first prior (0.5, 0.25, ...) drafts; rejections stop it



def test_where_unproposed_drafts_are_free_a_rarely_proposing_sequence_drafts_when_it_is_accepted():
    """Prompt lookup that finds a match one row in four, and is then right: per draft asked for it
    is accepted a quarter of the time, too little where each entry costs half a row, unless the
    device drops the drafts it did not propose (a CPU device), where asking costs a quarter entry."""
    def observed(planner: DraftPlanner) -> SequenceDrafts:
        state = SequenceDrafts(K)
        for row in range(100):
            proposed = K if row % 4 == 3 else 0
            planner.observe(state, K, proposed, proposed)
        return state

    seconds = [device_pb2.StepCost(rows=r, drafts=k, seconds=0.010 * r * (1 + 0.5 * k)) for r in (1, 2, 4, 8) for k in range(K + 1)]
    every_entry = DraftPlanner(K, StepCostModel(seconds))
    assert every_entry.plan([(observed(every_entry), K)], spare=100) == [0]
    proposed_only = DraftPlanner(K, StepCostModel(seconds, drops_unproposed=True))
    state = observed(proposed_only)
    assert state.proposal.reach()[0] == pytest.approx(0.25, abs=0.1)
    assert proposed_only.plan([(state, K)], spare=100) == [K]


def test_the_scheduler_learns_proposals_from_the_published_draft_totals():
    costs = StepCostModel([device_pb2.StepCost(rows=r, drafts=k, seconds=0.010 * r * (1 + 0.1 * k)) for r in (1, 2) for k in range(K + 1)],
                          drops_unproposed=True)
    scheduler = make_scheduler(num_speculative_tokens=K, max_step_tokens=32, step_costs=costs)
    scheduler.add_request(make_request("a", prompt_tokens=4, max_tokens=200))
    publish(scheduler, prefill := scheduler.schedule(), event(prefill, "a", tokens=[7]))
    state = scheduler._running[0].drafts
    total = 0
    for row in range(6):  # the proposer makes two drafts in every other row, the target accepts them
        step = scheduler.schedule()
        asked = step.num_draft_tokens[0]
        proposed = min(asked, 2 * (row % 2))
        total += proposed
        published = event(step, "a", tokens=[8] * (1 + proposed))
        published.draft_tokens = total
        publish(scheduler, step, published)
    assert state.proposed == total > 0
    assert 0.3 < state.proposal.rates()[0] < 0.7 and state.proposal.rates()[1] > 0.6


def test_with_prompt_lookup_the_replay_learns_from_rows_that_asked_for_no_drafts():
    """Where a draft costs half a row, a sequence starts without drafts (prior 0.5 per position is
    not enough); its output then copies its prompt: the replay of prompt lookup sees every row's
    drafts would have been accepted, and the sequence drafts, with no probe and no rejected draft."""
    scheduler = make_scheduler(num_speculative_tokens=K, max_step_tokens=64, max_prefill_chunk=64, step_costs=STEEP, speculative_method="ngram")
    request = make_request("a", prompt_tokens=60, max_tokens=100)
    scheduler.add_request(request)
    prompt = list(request.prompt_token_ids)
    publish(scheduler, prefill := scheduler.schedule(), event(prefill, "a", tokens=[prompt[0]]))  # the output restarts the prompt
    emitted, asked = 1, []
    for _ in range(12):
        step = scheduler.schedule()
        k = step.num_draft_tokens[0]
        asked.append(k)
        publish(scheduler, step, event(step, "a", tokens=prompt[emitted : emitted + 1 + k]))  # the copy: every draft right
        emitted += 1 + k
    assert asked[0] == 0 and asked[-1] == K
    assert scheduler._running[0].drafts.probe_after == FIRST_PROBE_ROWS  # learnt without probing
