"""Trace analyzer on hand-written traces: pairing by ticket, lifecycle validation, timing-source
labels, warm-up, request latencies, speculative acceptance; the CLI; the timeline plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stageserve.trace_tools import main as trace_main
from stageserve.trace_tools.analyze import (
    ASYNC_SOURCE,
    BLOCKING_SOURCE,
    TraceLifecycleError,
    analyze,
    format_markdown,
)

PREPARE, DEVICE, RECLAIM = 100, 200, 300  # pids
SUBMIT_TID, LANE_TID = 1, 2
ORIGIN_MS = 5_000.0  # traces do not start at 0: times in reports are relative to the first event


def span(name: str, start_ms: float, dur_ms: float, pid: int, tid: int = 1, **args: object) -> dict:
    """A complete event; times given in ms, written in us like the tracer does."""
    return {"ph": "X", "name": name, "cat": name.partition(".")[0], "ts": (ORIGIN_MS + start_ms) * 1000,
            "dur": dur_ms * 1000, "pid": pid, "tid": tid, "args": args}


def async_event(ph: str, name: str, at_ms: float, request_id: str, **args: object) -> dict:
    return {"ph": ph, "name": name, "cat": "request", "ts": (ORIGIN_MS + at_ms) * 1000, "pid": PREPARE,
            "tid": 1, "id": request_id, "args": args}


def metadata() -> list[dict]:
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in ((PREPARE, "prepare"), (DEVICE, "device"), (RECLAIM, "reclaim"))]


def step_spans(step: int, ticket: int, submit_ms: float, completion_ms: float, wait_start_ms: float) -> list[dict]:
    """Prepare (0.5 + 0.3 + 0.2 ms before the submit), async device spans, reclaim (0.4 + 0.6 ms
    after the completion); host time on the critical path = 2.0 ms per step."""
    return [
        span("prepare.schedule", submit_ms - 1.0, 0.5, PREPARE, step_id=step, batch_size=4, decode_tokens=4,
             prefill_tokens=0),
        span("prepare.build_plan", submit_ms - 0.5, 0.3, PREPARE, step_id=step),
        span("prepare.send", submit_ms - 0.2, 0.2, PREPARE, step_id=step),
        span("device.upload", submit_ms, 0.2, DEVICE, SUBMIT_TID, step_id=step),
        span("device.submit", submit_ms, 1.0, DEVICE, SUBMIT_TID, step_id=step, ticket=ticket, batch_size=4),
        span("device.wait", wait_start_ms, completion_ms - wait_start_ms, DEVICE, LANE_TID, step_id=step,
             ticket=ticket),
        span("device.copy_out", completion_ms, 0.05, DEVICE, LANE_TID, step_id=step, ticket=ticket),
        span("reclaim.wait", submit_ms + 1.0, completion_ms - submit_ms - 1.0, RECLAIM, 2, step_id=step,
             ticket=ticket),
        span("reclaim.detokenize", completion_ms + 0.1, 0.4, RECLAIM, step_id=step),
        span("reclaim.publish", completion_ms + 0.5, 0.6, RECLAIM, step_id=step),
    ]


def pipelined_trace(warmup_steps: int = 2, steady_steps: int = 6) -> list[dict]:
    """Warm-up steps run 40 ms one after another; steady steps are submitted every 10 ms and
    complete 15 ms after their submit, so step N+1 is always submitted while N is in flight."""
    events = metadata()
    submit_ms, previous_completion = 0.0, 0.0
    for index in range(warmup_steps + steady_steps):
        warm = index < warmup_steps
        completion = submit_ms + (40.0 if warm else 15.0)
        wait_start = max(submit_ms + 1.0, previous_completion + 0.05)  # after the previous copy_out
        events += step_spans(100 + index, index + 1, submit_ms, completion, wait_start)
        previous_completion = completion
        submit_ms += 40.0 if warm else 10.0
    return events


def blocking_trace(steps: int = 5) -> list[dict]:
    """--dispatch sync: one 8 ms blocking span per step, submitted every 10 ms."""
    events = metadata()
    for index in range(steps):
        start = 10.0 * index + 1.0
        events += [
            span("prepare.schedule", start - 1.0, 0.6, PREPARE, step_id=index),
            span("device.blocking_step", start, 8.0, DEVICE, step_id=index, ticket=index + 1,
                 timing_source=BLOCKING_SOURCE),
            span("reclaim.publish", start + 8.2, 0.5, RECLAIM, step_id=index),
        ]
    return events


def by_name(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("name") == name]


# -- pairing and steady statistics ------------------------------------------------------------


def test_overlapping_submits_are_paired_by_ticket_not_by_order() -> None:
    # Ticket 2's waiter starts before ticket 1's (two waiter threads), so the waits sorted by start
    # are [t2, t1]: pairing the n-th submit with the n-th wait would swap them.
    events = metadata() + [
        span("device.submit", 0.0, 1.0, DEVICE, SUBMIT_TID, step_id=0, ticket=1),
        span("device.submit", 2.0, 1.0, DEVICE, SUBMIT_TID, step_id=1, ticket=2),
        span("device.wait", 3.5, 8.5, DEVICE, 3, step_id=1, ticket=2),  # 3.5 -> 12 ms
        span("device.wait", 4.0, 6.0, DEVICE, 2, step_id=0, ticket=1),  # 4 -> 10 ms
    ]
    submits = sorted(by_name(events, "device.submit"), key=lambda e: e["ts"])
    waits = sorted(by_name(events, "device.wait"), key=lambda e: e["ts"])
    by_order_ms = [(w["ts"] + w["dur"] - s["ts"]) / 1000 for s, w in zip(submits, waits)]
    assert by_order_ms == pytest.approx([12.0, 8.0])

    report = analyze(events, warmup=0)
    assert report["timing_source"] == ASYNC_SOURCE
    steps = report["steps"]
    assert [(s["ticket"], s["step_id"]) for s in steps] == [(1, 0), (2, 1)]
    assert [s["submit_to_completion_ms"] for s in steps] == pytest.approx([10.0, 10.0])
    assert [s["submit_to_completion_ms"] for s in steps] != pytest.approx(by_order_ms)
    assert steps[0]["period_ms"] == pytest.approx(2.0) and steps[1]["period_ms"] is None


def test_warmup_steps_are_excluded_from_steady_statistics() -> None:
    events = pipelined_trace(warmup_steps=2, steady_steps=6)
    report = analyze(events, warmup=2)
    assert report["steps_total"] == 8 and report["steps_steady"] == 6
    steady = report["steady"]
    device = steady["submit_to_completion_ms"]
    assert (device["n"], device["mean"], device["median"], device["p99"]) == (6, pytest.approx(15.0),
                                                                            pytest.approx(15.0), pytest.approx(15.0))
    assert steady["period_ms"]["n"] == 5  # the last step has no successor
    assert steady["period_ms"]["mean"] == pytest.approx(10.0)
    # prepare 0.5 + 0.3 + 0.2, reclaim 0.4 + 0.6; reclaim.wait is waiting, not host work
    assert steady["host_ms"]["mean"] == pytest.approx(2.0)
    assert steady["prepare_ms"]["mean"] == pytest.approx(1.0)
    assert steady["reclaim_ms"]["mean"] == pytest.approx(1.0)
    assert steady["batch_size"]["mean"] == 4
    assert steady[f"overlap_ratio_{ASYNC_SOURCE}"] == pytest.approx(1.0)
    assert steady[f"pipelined_fraction_{ASYNC_SOURCE}"] == pytest.approx(1.0)
    first = report["steps"][0]
    assert (first["step_id"], first["ticket"], first["start_ms"]) == (100, 1, pytest.approx(1.0))

    with_warmup = analyze(events, warmup=0)["steady"]
    assert with_warmup["submit_to_completion_ms"]["mean"] == pytest.approx((2 * 40.0 + 6 * 15.0) / 8)
    assert with_warmup["submit_to_completion_ms"]["max"] == pytest.approx(40.0)
    # warm-up steps 0 and 1 complete before their successors are submitted: 5 of 7 pairs overlap
    assert with_warmup[f"pipelined_fraction_{ASYNC_SOURCE}"] == pytest.approx(5 / 7)


def test_p99_interpolates_between_the_two_largest_values() -> None:
    events = metadata()
    for index, device_ms in enumerate([1.0, 2.0, 3.0, 4.0, 100.0]):
        start = 200.0 * index + 1.0
        events += [span("device.blocking_step", start, device_ms, DEVICE, step_id=index, ticket=index + 1)]
    stats = analyze(events, warmup=0)["steady"]["blocking_span_ms"]
    assert stats["median"] == pytest.approx(3.0)
    assert stats["p99"] == pytest.approx(4.0 + 0.96 * 96.0)  # numpy 'linear': rank 0.99 * 4 = 3.96


def test_blocking_only_trace_is_labelled_blocking_span() -> None:
    report = analyze(blocking_trace(steps=5), warmup=0)
    assert report["timing_source"] == BLOCKING_SOURCE
    steady = report["steady"]
    assert "submit_to_completion_ms" not in steady
    assert steady["blocking_span_ms"]["mean"] == pytest.approx(8.0)
    assert steady["period_ms"]["mean"] == pytest.approx(10.0)
    assert steady["host_ms"]["mean"] == pytest.approx(1.1)
    assert steady[f"overlap_ratio_{BLOCKING_SOURCE}"] == pytest.approx(5 * 8.0 / (4 * 10.0 + 8.0))
    assert steady[f"pipelined_fraction_{BLOCKING_SOURCE}"] == 0.0
    assert all("blocking_span_ms" in s and "submit_to_completion_ms" not in s for s in report["steps"])
    markdown = format_markdown(report)
    assert "blocking_span" in markdown and ASYNC_SOURCE not in markdown


# -- lifecycle validation ---------------------------------------------------------------------


def test_wait_starting_before_its_submit_ended_is_rejected() -> None:
    events = metadata() + [
        span("device.submit", 0.0, 2.0, DEVICE, step_id=0, ticket=7),
        span("device.wait", 1.5, 5.0, DEVICE, LANE_TID, step_id=0, ticket=7),
    ]
    with pytest.raises(TraceLifecycleError, match="ticket 7: device.wait starts") as error:
        analyze(events)
    assert error.value.ticket == 7


def test_missing_wait_is_rejected() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=5)
    events.remove(next(e for e in by_name(events, "device.wait") if e["args"]["ticket"] == 3))
    with pytest.raises(TraceLifecycleError, match="ticket 3 has no device.wait") as error:
        analyze(events)
    assert error.value.ticket == 3


def test_duplicate_wait_is_rejected() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=4)
    duplicate = dict(next(e for e in by_name(events, "device.wait") if e["args"]["ticket"] == 2))
    duplicate["ts"] += 100.0
    events.append(duplicate)
    with pytest.raises(TraceLifecycleError, match="ticket 2 has two device.wait spans") as error:
        analyze(events)
    assert error.value.ticket == 2


def test_wait_without_submit_inside_the_window_is_rejected() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=5)
    events.remove(next(e for e in by_name(events, "device.submit") if e["args"]["ticket"] == 4))
    with pytest.raises(TraceLifecycleError, match="ticket 4 has a device.wait span but no device.submit"):
        analyze(events)


def test_mixed_blocking_and_async_spans_are_rejected() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=3)
    events.append(span("device.blocking_step", 500.0, 8.0, DEVICE, step_id=99, ticket=42))
    with pytest.raises(TraceLifecycleError, match="mixes device.blocking_step \\(ticket 42\\)") as error:
        analyze(events)
    assert error.value.ticket == 42


def test_steps_cut_by_the_trace_window_are_tolerated_at_its_edges() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=6)
    # The window opened after ticket 1 was submitted and closed before ticket 6 completed.
    events.remove(next(e for e in by_name(events, "device.submit") if e["args"]["ticket"] == 1))
    events.remove(next(e for e in by_name(events, "device.wait") if e["args"]["ticket"] == 6))
    report = analyze(events, warmup=0)
    assert [s["ticket"] for s in report["steps"]] == [2, 3, 4, 5]


def test_device_spans_of_two_processes_are_rejected() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=2)
    events.append(span("device.submit", 900.0, 1.0, DEVICE + 1, step_id=0, ticket=1))
    with pytest.raises(ValueError, match="device spans of 2 processes"):
        analyze(events)


# -- requests and speculative decoding --------------------------------------------------------


def test_request_latencies_from_async_spans_and_token_instants() -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=2) + [
        async_event("b", "request.total", 0.0, "r1"),
        async_event("b", "request.queue", 0.0, "r1"),
        async_event("b", "request.ttft", 0.0, "r1"),
        async_event("e", "request.queue", 2.0, "r1"),
        async_event("n", "request.token", 20.0, "r1", tokens=1),
        async_event("e", "request.ttft", 20.0, "r1"),
        async_event("n", "request.token", 30.0, "r1", tokens=1),
        async_event("n", "request.token", 50.0, "r1", tokens=2),  # 2 tokens in 20 ms: 10 ms each
        async_event("e", "request.total", 51.0, "r1"),
        async_event("b", "request.total", 40.0, "r2"),  # still running when the window closed
    ]
    report = analyze(events, warmup=0)
    requests = report["requests"]
    assert requests["count"] == 1  # r2 has no complete span yet
    r1 = next(r for r in requests["per_request"] if r["request_id"] == "r1")
    assert r1["queue_ms"] == pytest.approx(2.0)
    assert r1["ttft_ms"] == pytest.approx(20.0)
    assert r1["total_ms"] == pytest.approx(51.0)
    assert r1["itl_mean_ms"] == pytest.approx(10.0) and r1["tokens_after_first"] == 3
    assert requests["itl_ms"]["n"] == 3 and requests["ttft_ms"]["n"] == 1
    assert any("1 request spans were cut" in w for w in report["warnings"])


def test_request_that_ended_before_its_first_token_has_no_ttft() -> None:
    """prepare closes request.ttft with no_token when a request ends without a token (aborted in
    the queue, failed): that is not a time to first token and must not enter the TTFT figures."""
    events = pipelined_trace(warmup_steps=0, steady_steps=2) + [
        async_event("b", "request.total", 0.0, "r1"),
        async_event("b", "request.ttft", 0.0, "r1"),
        async_event("e", "request.ttft", 5.0, "r1", no_token=True),
        async_event("e", "request.total", 5.0, "r1"),
    ]
    requests = analyze(events, warmup=0)["requests"]
    r1 = next(r for r in requests["per_request"] if r["request_id"] == "r1")
    assert r1["ttft_ms"] is None and r1["total_ms"] == pytest.approx(5.0)
    assert requests["ttft_ms"] is None  # no request had a first token: no TTFT figure at all


def test_speculative_acceptance_over_steady_steps() -> None:
    events = pipelined_trace(warmup_steps=1, steady_steps=3)
    accepted = {100: 0, 101: 2, 102: 3, 103: 1}  # step 100 is warm-up
    for event in by_name(events, "reclaim.publish"):
        event["args"].update(accepted_tokens=accepted[event["args"]["step_id"]], draft_tokens=3)
    spec = analyze(events, warmup=1)["speculative"]
    assert spec == {"steps": 3, "accepted_tokens": 6, "draft_tokens": 9, "acceptance_rate": pytest.approx(6 / 9),
                    "mean_accepted_per_step": pytest.approx(2.0)}
    assert analyze(pipelined_trace(1, 3), warmup=1)["speculative"] is None


# -- the CLI ----------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="stageserve trace")
    trace_main.add_arguments(parser)
    return trace_main.run(parser.parse_args(list(argv)))


def write_trace(path: Path, events: list[dict], dropped: int = 0) -> Path:
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"fragments": [{"dropped_events": dropped}]}}))
    return path


def test_cli_analyze_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.json", pipelined_trace(warmup_steps=2, steady_steps=6))
    assert run_cli("analyze", str(trace), "--warmup", "2", "-o", str(tmp_path / "out" / "report")) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steady"]["submit_to_completion_ms"]["mean"] == pytest.approx(15.0)
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "device time, submit_to_completion (ms) | 15.000" in markdown
    assert "| 107 | 8 |" in markdown  # per-step table: step_id, ticket
    assert "Pipelined fraction (submit_to_completion" in capsys.readouterr().out


def test_cli_analyze_fails_with_the_offending_ticket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=4)
    events.remove(next(e for e in by_name(events, "device.wait") if e["args"]["ticket"] == 2))
    trace = write_trace(tmp_path / "trace.json", events, dropped=12)
    assert run_cli("analyze", str(trace)) == 1
    error = capsys.readouterr().err
    assert "ticket 2 has no device.wait" in error and "dropped 12 events" in error
    assert not (tmp_path / "report.json").exists()


def test_cli_merge_then_analyze_a_folder(tmp_path: Path) -> None:
    events = pipelined_trace(warmup_steps=0, steady_steps=3)
    for pid, service in ((PREPARE, "prepare"), (DEVICE, "device"), (RECLAIM, "reclaim")):
        mine = [e for e in events if e["pid"] == pid]
        (tmp_path / f"{service}-{pid}.trace.json").write_text(
            json.dumps({"traceEvents": mine, "otherData": {"service": service, "dropped_events": 0}}))
    assert run_cli("merge", str(tmp_path), "-o", str(tmp_path / "trace.json")) == 0
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert len(merged["traceEvents"]) == len(events)
    assert run_cli("analyze", str(tmp_path / "trace.json"), "--warmup", "0") == 0
    assert json.loads((tmp_path / "report.json").read_text())["steps_total"] == 3
    assert run_cli("merge", str(tmp_path / "missing"), "-o", str(tmp_path / "x.json")) == 1


# -- the timeline plot ------------------------------------------------------------------------


def test_plot_renders_a_timeline_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = write_trace(tmp_path / "trace.json", pipelined_trace(warmup_steps=1, steady_steps=6))
    out = tmp_path / "timeline.png"
    assert run_cli("plot", str(trace), "-o", str(out)) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # lanes, bars, labels and legend, not a blank canvas
    zoomed = tmp_path / "zoom.png"
    assert run_cli("plot", str(trace), "-o", str(zoomed), "--steps", "102:104") == 0
    assert zoomed.stat().st_size > 10_000


def test_plot_of_absent_steps_names_the_step_ids_the_trace_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.json", pipelined_trace(warmup_steps=1, steady_steps=6))
    assert run_cli("plot", str(trace), "-o", str(tmp_path / "zoom.png"), "--steps", "12:15") == 1
    assert "no spans with step_id in 12..15; this trace has step ids 100..106" in capsys.readouterr().err
    assert not (tmp_path / "zoom.png").exists()
