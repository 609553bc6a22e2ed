"""docs/pipeline-protocol.md's route of one request names only functions that exist."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOP = re.compile(r"`((?:prepare|device|reclaim)/[\w/]+\.py):([\w.]+)`")


def _route() -> str:
    text = (ROOT / "docs" / "pipeline-protocol.md").read_text()
    return text.split("## The route of one request", 1)[1].split("\n## ", 1)[0]


def _defines(path: Path, dotted: str) -> bool:
    scope = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = [node for node in scope if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_route_is_short_and_every_hop_exists():
    route = _route()
    hops = re.findall(r"^\d+\. ", route, flags=re.MULTILINE)
    assert 10 <= len(hops) <= 25
    named = HOP.findall(route)
    assert len(named) >= len(hops)
    missing = [f"{file}:{name}" for file, name in named if not _defines(ROOT / "services" / file, name)]
    assert missing == []
