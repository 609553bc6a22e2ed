"""Report arithmetic, workload determinism and the step-period reading of the benchmarks (no services)."""

from __future__ import annotations

import json

import pytest

from stageserve.bench.compare import steady_period_ms
from stageserve.bench.metrics import RequestRecord, build_report, percentile
from stageserve.bench.workload import Shape, Workload, load_prompts


def test_report_figures_from_hand_built_records():
    records = [
        RequestRecord(sent_s=0.0, chunks=[(0.1, 1), (0.2, 1), (0.4, 2)], ended_s=0.5, prompt_tokens=10, completion_tokens=4),
        RequestRecord(sent_s=0.5, ended_s=1.0, status="RESOURCE_EXHAUSTED"),
    ]
    report = build_report(records, {"k": 1})
    assert report["requests"] == {"sent": 2, "ok": 1, "failed": 1}
    assert report["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert report["wall_s"] == pytest.approx(1.0)
    assert report["output_tokens"] == 4 and report["output_tokens_per_s"] == pytest.approx(4.0)
    assert report["ttft_ms"]["mean"] == pytest.approx(100.0)
    # gaps: 100 ms for one token, then 200 ms spread over two tokens
    assert report["itl_ms"]["p50"] == pytest.approx(100.0) and report["itl_ms"]["mean"] == pytest.approx(100.0)
    assert report["e2e_ms"]["p99"] == pytest.approx(500.0)
    json.dumps(report)


def test_empty_statistics_keep_their_keys():
    report = build_report([RequestRecord(sent_s=0.0, ended_s=1.0, status="UNAVAILABLE")], {})
    assert report["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0


def test_workload_is_deterministic_and_shaped():
    prompts = load_prompts()
    assert len(prompts) >= 30
    tokenize = lambda request: [1, 2, 3]  # noqa: E731 - a stand-in tokenizer
    one = Workload(prompts, Shape(output_len=100, input_len=8, spread=0.5), seed=3, tokenize=tokenize)
    two = Workload(prompts, Shape(output_len=100, input_len=8, spread=0.5), seed=3, tokenize=tokenize)
    requests = [one.request(i) for i in range(20)]
    assert requests == [two.request(i) for i in range(20)]
    assert all(50 <= r.max_tokens <= 150 and 4 <= len(r.prompt_token_ids) <= 12 and r.ignore_eos for r in requests)
    assert list(requests[0].prompt_token_ids[:4]) == [1, 2, 3, 1]
    fixed = Workload(prompts, Shape(output_len=16), seed=0)
    assert {fixed.request(i).max_tokens for i in range(10)} == {16}
    assert fixed.request(0).messages or fixed.request(0).prompt


def test_bad_prompt_file_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompts(path)


def test_steady_period_uses_the_longest_full_run():
    samples = [(0.000, 1, 3)]  # a prefill step with fewer rows
    samples += [(0.010 + 0.005 * k, 2 + k, 4) for k in range(12)]  # 12 full steps, 5 ms apart
    samples += [(1.0, 14, 2)]
    assert steady_period_ms(samples, 4) == pytest.approx(5.0)
    assert steady_period_ms(samples[:5], 4) is None  # too few steps
