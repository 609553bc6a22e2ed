"""How many drafts each decode row of a step asks the device's proposer for.

Verifying a draft costs an entry in the step's forward pass whether the target accepts it or not,
and what an entry costs depends on the device and on the step (on a CPU the few-row quantized
kernel makes a one-row step cheap and a six-entry one not; a bfloat16 step of a few rows costs
about the same at one entry or six). So each step's drafts are chosen to maximise its expected
tokens per second (SmartSpec's goodput, Liu et al. 2024, "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput", there with one draft length per batch; here per row):

- each sequence's **acceptance** (a `RunEstimate`): per draft position ``j``, the probability that
  draft ``j`` is accepted when the drafts before it were, from its published rows; asking for
  draft ``j`` adds the product of these up to ``j`` in expected tokens (Leviathan et al. 2023,
  section 3.1, without their assumption of one rate for every position: a prompt-lookup draft that
  is right tends to stay right). A draft the proposer does not make (prompt lookup without a match)
  counts as not accepted, so this is per draft asked for;
- its **proposals** (a `RunEstimate` too), on a device that runs only the entries of proposed drafts
  (a CPU device, ``AttachReply.drops_unproposed_drafts``): the probability that the proposer makes
  draft ``j`` when it made the ones before, so that asking for it costs that fraction of an entry
  (elsewhere a whole one). Each position's prior, in both, is the scheduler-wide estimate of that
  position (whose own prior is 0.5 at the first position and the position before it at the
  others); counts decay exponentially, so that a request whose output starts or stops following its
  prompt is followed;
- with prompt lookup (``ngram``), both are learnt from **every row**: prepare replays the lookup on
  the published tokens (`draft_replay`) and, verification being exact, knows how many of the K
  drafts it would have made the target would have accepted, whether or not the row asked for any;
  with a draft model, from the rows that drafted;
- the step's **cost** (`StepCostModel`): the device's decode-step times by rows, drafts run per row
  and context, measured at its start-up (``device/speculation/step_costs.py``, carried in ``AttachReply.step_costs``);
- the planner takes drafts in order of expected tokens per expected entry and keeps the number that
  gives the most expected tokens (decode rows plus accepted drafts) per second; none unless that
  is at least 10 % more than without drafts (`MIN_SPEEDUP`: on the open-ended benchmark a served
  drafting step cost up to ~20 % more than the start-up measurement says, on a 2-core Intel Xeon
  with AMX, docs/benchmarks.md "With the draft planner", so a smaller predicted gain is as likely a
  loss).

Without a replay (a draft model), a sequence that has not drafted for a while **probes**: its next
row asks for one draft (the cheapest measurement of its acceptance), after 16 rows without drafts,
doubling after each probe that did not lead to drafting, up to 256; so a request whose output
turns repetitive is noticed.

The measured costs are the device's alone; a served step also waits for the host's work
(prepare, reclaim, the client), on the same cores on a small machine, which preempts the compute
threads about in proportion to the step's length: a common factor, which does not change the
choice.

A device without measured costs (``--speculative-policy always``) gets ``K`` drafts on every row.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stageserve.prepare.draft_replay import DraftReplay
    from stageserve.prepare.validation import GenerationRequest
    from stageserve.v1 import device_pb2

log = logging.getLogger(__name__)

DECAY = 0.9  # per observed row (a drafting one, or with prompt lookup every one): a sequence follows its last ~10
PRIOR_DECAY = 0.99  # the scheduler-wide estimates follow the last ~100 observed rows of all sequences
PRIOR_TRIALS = 2.0  # weight of a scheduler-wide estimate in a sequence's
FIRST_ACCEPTANCE = 0.5  # the scheduler-wide prior of a first draft before any row was published
FIRST_PROBE_ROWS = 16
MAX_PROBE_ROWS = 256
MIN_GAIN = 0.01  # expected tokens below which a draft is not considered
MIN_SPEEDUP = 1.10  # predicted goodput over no drafts below which a step drafts nothing: within the model's error


@dataclass(slots=True)
class RunEstimate:
    """How far a decode row's run of drafts goes, per draft position ``j`` (0 = the first): decayed
    counts of the published rows that asked for draft ``j`` with the run reaching it (every draft
    before it accepted, or proposed: whichever run this estimates; ``trials[j]``), and of those
    whose run went on through ``j`` (``successes[j]``); ``decay``: the factor of a position's counts
    per row that updates it.
    """

    successes: list[float]
    trials: list[float]
    decay: float

    @classmethod
    def empty(cls, max_drafts: int, decay: float = DECAY) -> RunEstimate:
        """No rows seen, ``max_drafts`` positions."""
        return cls([0.0] * max_drafts, [0.0] * max_drafts, decay)

    def observe(self, asked: int, run: int) -> None:
        """A published row that asked for ``asked`` drafts, whose run went through ``run`` of them."""
        for j in range(min(asked, run + 1, len(self.trials))):
            self.trials[j] = self.decay * self.trials[j] + 1.0
            self.successes[j] = self.decay * self.successes[j] + (run > j)

    def rates(self, prior: list[float] | None = None) -> list[float]:
        """Each position's probability of going on after the ones before it: successes / trials with
        `PRIOR_TRIALS` rows of prior, ``prior[j]`` at position ``j``; without ``prior``,
        `FIRST_ACCEPTANCE` at the first position and the estimate of the position before at the others."""
        rates, previous = [], FIRST_ACCEPTANCE
        for j, (s, t) in enumerate(zip(self.successes, self.trials)):
            previous = (s + PRIOR_TRIALS * (previous if prior is None else prior[j])) / (t + PRIOR_TRIALS)
            rates.append(previous)
        return rates

    def reach(self, prior: list[float] | None = None) -> list[float]:
        """Per position, the probability that the run goes through it: the product of the `rates`
        up to it (for acceptance: the expected tokens each draft adds)."""
        reach, product = [], 1.0
        for rate in self.rates(prior):
            product *= rate
            reach.append(product)
        return reach


@dataclass(slots=True)
class SequenceDrafts:
    """One sequence's drafting state (not thread-safe; the scheduler's lock).

    Attributes:
        max_drafts: the device's K, or 0 when the request's sampling forbids drafts (`may_draft`).
        acceptance: its accepted drafts' `RunEstimate`; ``proposal``: its proposed drafts'.
        replay: with the device's prompt lookup (``ngram``), the replay of what it would have
            drafted at every row (`draft_replay`), which the estimates learn from instead of the
            rows that drafted; ``None``: they learn from those (a draft model).
        proposed: without a replay, drafts the device's proposer made for it so far
            (``SequenceEvent.draft_tokens``).
        rows_without_drafts: decode rows planned since it last asked for drafts.
        probe_after: ``rows_without_drafts`` at which its next row probes (without a replay).
    """

    max_drafts: int
    acceptance: RunEstimate = None  # type: ignore[assignment]  # set in __post_init__
    proposal: RunEstimate = None  # type: ignore[assignment]
    replay: DraftReplay | None = None
    proposed: int = 0
    rows_without_drafts: int = 0
    probe_after: int = FIRST_PROBE_ROWS

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = RunEstimate.empty(self.max_drafts)
        if self.proposal is None:
            self.proposal = RunEstimate.empty(self.max_drafts)


class StepCostModel:
    """A decode step's seconds by decode rows, drafts run and context, from the device's measurements.

    The table measured at the short context is made monotone (a step never costs less for more rows
    or drafts: the fastest of a few runs can dip); between measured row counts the time is
    interpolated linearly, past the largest it grows in proportion to the rows; a step of ``rows``
    rows carrying ``drafts`` drafts in all costs as ``rows`` rows of ``drafts / rows`` drafts each,
    interpolated. Each context token past the short context adds ``per_row + per_entry * (1 + k)``
    seconds per row of ``k`` drafts (every entry attends to the row's context; the entries of one
    row find it in cache after the first), fitted by least squares over ``k`` to the line measured
    at a long context, neither below 0; without that line the context adds nothing.

    ``drops_unproposed``: the device runs only the entries of proposed drafts
    (``AttachReply.drops_unproposed_drafts``), so a draft asked for costs only where it is proposed.
    """

    def __init__(self, costs: list[device_pb2.StepCost], drops_unproposed: bool = False) -> None:
        """Raises ``KeyError`` naming a ``(rows, drafts)`` cell the table lacks."""
        self.drops_unproposed = drops_unproposed
        self.context = min(cost.context_tokens for cost in costs)
        base = {(cost.rows, cost.drafts): cost.seconds for cost in costs if cost.context_tokens == self.context}
        self.rows = sorted({rows for rows, _ in base})
        self.max_drafts = max(drafts for _, drafts in base)
        self.seconds: list[list[float]] = []
        for i, rows in enumerate(self.rows):
            line = [base[rows, k] for k in range(self.max_drafts + 1)]
            for k in range(1, len(line)):
                line[k] = max(line[k], line[k - 1])
            if i:
                line = [max(value, below) for value, below in zip(line, self.seconds[-1])]
            self.seconds.append(line)
        self.per_row, self.per_entry = self._context_cost(base, [cost for cost in costs if cost.context_tokens != self.context])

    def _context_cost(self, base: dict[tuple[int, int], float], long: list[device_pb2.StepCost]) -> tuple[float, float]:
        """``(per_row, per_entry)`` seconds per context token (class docstring); ``(0, 0)`` without a long line."""
        if not long:
            return 0.0, 0.0
        x = [1.0 + cost.drafts for cost in long]
        y = [(cost.seconds - base[cost.rows, cost.drafts]) / (cost.rows * (cost.context_tokens - self.context)) for cost in long]
        mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
        spread = sum((v - mean_x) ** 2 for v in x)
        slope = sum((u - mean_x) * (v - mean_y) for u, v in zip(x, y)) / spread if spread else 0.0
        if slope <= 0:
            return max(0.0, mean_y), 0.0
        if mean_y - slope * mean_x < 0:
            return 0.0, max(0.0, sum(u * v for u, v in zip(x, y)) / sum(u * u for u in x))
        return mean_y - slope * mean_x, slope

    @classmethod
    def from_attach(cls, reply: device_pb2.AttachReply) -> StepCostModel | None:
        """The model of ``reply.step_costs``; ``None`` when the device measured none, or not a whole
        table (rows x drafts 0..K at its shortest context, each long-context cell's counterpart)."""
        if not reply.step_costs:
            return None
        try:
            return cls(list(reply.step_costs), reply.drops_unproposed_drafts)
        except KeyError as missing:
            log.warning("the device's step costs lack %s; every decode row asks for %d drafts", missing, reply.num_speculative_tokens)
            return None

    def seconds_by_drafts(self, rows: int, context: float) -> list[float]:
        """Seconds of a decode step of ``rows`` >= 1 rows of ``context`` tokens on average, by
        drafts per row, ``[0, max_drafts]``."""
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            line = self.seconds[i]
        elif i == 0:
            line = self.seconds[0]
        elif i == len(self.rows):
            line = [value * rows / self.rows[-1] for value in self.seconds[-1]]
        else:
            r0, r1 = self.rows[i - 1], self.rows[i]
            line = [low + (high - low) * (rows - r0) / (r1 - r0) for low, high in zip(self.seconds[i - 1], self.seconds[i])]
        extra = max(0.0, context - self.context) * rows
        return [value + extra * (self.per_row + self.per_entry * (1 + k)) for k, value in enumerate(line)]

    def step_seconds(self, by_drafts: list[float], rows: int, drafts: float) -> float:
        """Seconds of a step of ``rows`` rows running ``drafts`` drafts in all (an expected number:
        fractional), from its `seconds_by_drafts` line (interpolated at ``drafts / rows`` per row)."""
        per_row = min(drafts / rows, self.max_drafts)
        low = int(per_row)
        high = min(low + 1, self.max_drafts)
        return by_drafts[low] + (by_drafts[high] - by_drafts[low]) * (per_row - low)


class DraftPlanner:
    """Chooses every decode row's drafts for a step (module docstring).

    Args:
        max_drafts: the device's K.
        costs: the device's `StepCostModel`; ``None``: every row asks for as many as it may.
    """

    def __init__(self, max_drafts: int, costs: StepCostModel | None) -> None:
        self.costs = costs
        # Over every sequence: each one's priors.
        self.acceptance = RunEstimate.empty(max_drafts, PRIOR_DECAY)
        self.proposal = RunEstimate.empty(max_drafts, PRIOR_DECAY)

    def plan(self, rows: list[tuple[SequenceDrafts, int]], spare: int, context: float = 0.0) -> list[int]:
        """Drafts for each of a step's decode rows, given as ``(drafts state, cap)`` (``cap``: the
        drafts the row may carry before passing ``max_tokens``); ``spare``: the step's budget
        tokens left after every decode row has its one; ``context``: the rows' mean KV tokens."""
        caps = [max(0, min(state.max_drafts, cap)) for state, cap in rows]
        costs = self.costs
        if costs is None or not rows:
            return self._in_order(caps, spare)
        accepted_prior = self.acceptance.rates()
        proposed_prior = self.proposal.rates() if costs.drops_unproposed else None
        chosen = [0] * len(rows)
        probes, probe_entries = set(), 0.0
        candidates = []  # (expected tokens per expected entry, expected tokens, expected entries, row)
        for i, ((state, _), cap) in enumerate(zip(rows, caps)):
            if not cap:
                continue
            entries = state.proposal.reach(proposed_prior)[:cap] if costs.drops_unproposed else [1.0] * cap
            if state.replay is None and state.rows_without_drafts >= state.probe_after and len(probes) < spare:
                chosen[i] = 1
                probes.add(i)
                probe_entries += entries[0]
                continue
            ratio = float("inf")
            for gain, entry in zip(state.acceptance.reach(accepted_prior)[:cap], entries):
                if gain < MIN_GAIN:
                    break
                ratio = min(ratio, gain / max(entry, gain))  # never above the draft before it: a row's drafts go in order
                candidates.append((ratio, gain, entry, i))
        candidates.sort(key=lambda candidate: -candidate[0])
        by_drafts = costs.seconds_by_drafts(len(rows), context)
        best = MIN_SPEEDUP * len(rows) / costs.step_seconds(by_drafts, len(rows), probe_entries)
        best_n, tokens, entries_run = 0, 0.0, probe_entries
        for n, (_, gain, entry, _) in enumerate(candidates[: spare - len(probes)], start=1):
            tokens += gain
            entries_run += entry
            goodput = (len(rows) + tokens) / costs.step_seconds(by_drafts, len(rows), entries_run)
            if goodput > best:
                best, best_n = goodput, n
        for *_, i in candidates[:best_n]:
            chosen[i] += 1
        for i, ((state, _), k, cap) in enumerate(zip(rows, chosen, caps)):
            if cap:
                _note_planned(state, k, probe=i in probes)
        return chosen

    def observe(self, state: SequenceDrafts, asked: int, proposed: int, accepted: int) -> None:
        """A published decode row of ``state``'s sequence that asked for ``asked`` drafts, of which
        the proposer made ``proposed`` and the target accepted ``accepted``."""
        if asked:
            state.acceptance.observe(asked, accepted)
            state.proposal.observe(asked, proposed)
            self.acceptance.observe(asked, accepted)
            self.proposal.observe(asked, proposed)

    @staticmethod
    def _in_order(caps: list[int], spare: int) -> list[int]:
        chosen = []
        for cap in caps:
            chosen.append(min(cap, spare))
            spare -= chosen[-1]
        return chosen


def _note_planned(state: SequenceDrafts, drafts: int, probe: bool) -> None:
    """Advance ``state``'s probe schedule after a row of it with ``drafts`` drafts was planned."""
    if drafts == 0:
        state.rows_without_drafts += 1
    else:
        state.rows_without_drafts = 0
        # A forced probe: the next one waits twice as long, unless drafting resumes first.
        state.probe_after = min(2 * state.probe_after, MAX_PROBE_ROWS) if probe else FIRST_PROBE_ROWS


def may_draft(request: GenerationRequest) -> bool:
    """Whether a request's rows may carry drafts: not with a repetition, presence or frequency
    penalty, whose logits at a draft's position would depend on the drafts before it (the device
    refuses such rows), nor with a constraint, whose mask at a draft's position would depend on the
    drafts before it (the device masks one entry per constrained row)."""
    sampling = request.sampling
    penalised = sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0
    return not penalised and request.constraint is None
