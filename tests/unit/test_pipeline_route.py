"""docs/pipeline-protocol.md's route of one request names only functions that exist, and the thread of every hop."""

import ast
import re
from pathlib import Path

from stageserve.v1 import common_pb2, device_pb2, prepare_pb2, reclaim_pb2

ROOT = Path(__file__).resolve().parents[2]
HOP = re.compile(r"`((?:prepare|device|reclaim)/[\w/]+\.py):([\w.]+)`")
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| (.+) \|$", flags=re.MULTILINE)
NAME = re.compile(r"`([A-Za-z_]\w*(?:\.\w+)*)`")


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


def _wire_names() -> set[str]:
    """Messages, their fields, services and their methods (``Method``, ``Service.Method``): the wire protocol's names."""
    names = set()
    for module in (common_pb2, device_pb2, prepare_pb2, reclaim_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            names |= {message.name, *(f.name for f in message.fields)}
        for service in module.DESCRIPTOR.services_by_name.values():
            names |= {service.name, *(m.name for m in service.methods), *(f"{service.name}.{m.name}" for m in service.methods)}
    return names


def test_route_is_short_and_every_hop_names_its_thread():
    rows = ROW.findall(_route())
    assert 10 <= len(rows) <= 25
    assert [int(number) for number, _, _ in rows] == list(range(1, len(rows) + 1))
    assert all(thread.strip() for _, thread, _ in rows)


def test_every_named_function_exists():
    """``file.py:name`` hops are defined in that file; a bare ``name`` or ``Class.method`` (a later
    mention of something the route already placed) is defined in one of the files the route names,
    or is a name of the wire protocol."""
    hops = [hop for _, _, hop in ROW.findall(_route())]
    named = [pair for hop in hops for pair in HOP.findall(hop)]
    assert len(named) >= len(hops)
    missing = [f"{file}:{name}" for file, name in named if not _defines(ROOT / "services" / file, name)]
    assert missing == []
    files = {ROOT / "services" / file for file, _ in named}
    bare = {name for hop in hops for name in NAME.findall(HOP.sub("", hop))}
    wire = _wire_names()
    unknown = sorted(name for name in bare if name not in wire and not any(_defines(path, name) for path in files))
    assert unknown == []
