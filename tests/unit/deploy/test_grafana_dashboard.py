"""The Grafana dashboard's shape (deploy/grafana/stageserve.json); its queries are checked against
the live /metrics of the real services in tests/integration/test_observability.py."""

from __future__ import annotations

from tests.grafana_dashboard import expressions, label_names, load_dashboard, metric_names


def test_every_panel_queries_stageserve_metrics_through_the_datasource_variable():
    dashboard = load_dashboard()
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']} runs off the 24-column grid"
        for target in panel["targets"]:
            assert metric_names(target["expr"]), f"{panel['title']}: {target['expr']} reads no stageserve or process metric"


def test_queries_cover_the_issue_s_figures():
    names = set().union(*(metric_names(expr) for _, expr in expressions(load_dashboard())))
    for family in ("stageserve_time_to_first_token_seconds_bucket", "stageserve_kv_cache_usage_ratio",
                   "stageserve_request_prefill_time_seconds_bucket", "stageserve_request_decode_time_seconds_bucket",
                   "stageserve_model_info", "process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"):
        assert family in names


def test_label_parsing():
    expr = 'histogram_quantile(0.5, sum by (le, timing_source) (rate(x_bucket{component=~"a|b", pod!="c"}[5m])))'
    assert label_names(expr) == {"le", "timing_source", "component", "pod"}
