"""Submit one plan and answer with its receipt: what the device's Execute handler does per plan, and
what the in-process benchmark baseline calls in its place.

Per plan: 1. check that its ``step_id`` follows the stream's previous one, decode it and check
what needs no sequence state (`step_plan.decode_plan`); 2. wait for a free output slot (the only
wait: for reclaim's ``SlotRelease``, never for a completion); 3. check it against the sequence
table and commit it (`SequenceTable.admit`); 4. submit it (`StepExecutor.submit`, which pushes the
`StepTicket` to the outbox before the step's output can be); 5. answer the ``StepReceipt``. A
refused plan gets a receipt with ``error`` set and ticket 0; the stream carries on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from stageserve.device.step_plan import PlanError, decode_plan
from stageserve.v1 import device_pb2

if TYPE_CHECKING:
    from stageserve.device.service import DeviceCore

log = logging.getLogger(__name__)

STREAM_POLL_S = 0.1
"""How often a device stream's blocked loop looks at whether its RPC is still alive (seconds)."""


class PlanSubmitter:
    """Turns the plans of one Execute stream into submitted steps and receipts (see the module docstring).

    Creating it resets the sequence table (and the grammar state): a new stream starts with no sequence.

    Args:
        core: the device's model, table and executor.
        submit_lock: serialises table commits and submits with a new stream's reset, across all
            streams of ``core`` (a cancelled stream's handler may still run when the next opens).
        stream_open: False once the stream is gone; a plan still waiting for a slot is then
            dropped without a receipt.
    """

    def __init__(self, core: DeviceCore, submit_lock: threading.Lock, stream_open: Callable[[], bool] = lambda: True) -> None:
        self._core, self._lock, self._stream_open = core, submit_lock, stream_open
        self._last_step_id = 0
        with submit_lock:
            core.table.reset()
            if core.grammar is not None:
                core.grammar.reset()

    def submit(self, plan: device_pb2.StepPlan) -> device_pb2.StepReceipt | None:
        """Submit ``plan``; its receipt, or ``None`` when the stream closed while it waited for a slot."""
        core = self._core
        try:
            if plan.step_id <= self._last_step_id:
                raise PlanError(f"step_id {plan.step_id} must be greater than the previous step_id {self._last_step_id}")
            step = decode_plan(plan, core.limits, core.check_sampling)
            while not core.executor.wait_for_free_slot(STREAM_POLL_S):
                if not self._stream_open():
                    return None
            with self._lock:
                if not self._stream_open():
                    return None
                ticket = core.executor.submit(core.table.admit(step))  # a slot is free and this is the only submitter
        except PlanError as exc:
            log.warning("refused plan: %s", exc)
            return device_pb2.StepReceipt(step_id=plan.step_id, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug refuses this plan, never the stream or the service
            log.exception("refused plan %d: internal error", plan.step_id)
            return device_pb2.StepReceipt(step_id=plan.step_id, error=f"internal error in the device: {type(exc).__name__}: {exc}")
        self._last_step_id = plan.step_id
        return device_pb2.StepReceipt(step_id=plan.step_id, ticket=ticket.ticket_id, slot=ticket.slot, submitted_unix_ns=ticket.submitted_unix_ns)
