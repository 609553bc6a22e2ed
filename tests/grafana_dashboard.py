"""Reading deploy/grafana/stageserve.json: its panels' PromQL and the metric and label names the
queries use (for the unit test of its shape and the integration test against a live /metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "stageserve.json"
# Every series the dashboard reads is one of these families.
METRIC = re.compile(r"\b((?:stageserve|process|python)_[a-z0-9_]+)\b")
# Labels Prometheus adds when it scrapes (the PodMonitor's relabelings, target labels) and ``le``
# of histogram buckets: not exported by the services themselves.
SCRAPE_LABELS = {"component", "pod", "namespace", "job", "instance", "le"}
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def label_names(expr: str) -> set[str]:
    """Labels the query groups by or matches on (``by (...)`` and ``{...}``)."""
    grouped = {name.strip() for clause in _BY.findall(expr) for name in clause.split(",") if name.strip()}
    matched = {name for clause in _MATCHERS.findall(expr) for name in _MATCHER_LABEL.findall(clause)}
    return grouped | matched
