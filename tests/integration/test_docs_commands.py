"""Every command block of README.md and docs/*.md, read from the Markdown at test time and run
against real services, so a documentation example that breaks fails the suite.

What runs: each fenced block whose language is ``bash`` (run by ``bash -euo pipefail``) or
``python`` (run by this interpreter), in the order of its document, all blocks of one document in
one scratch folder (so a later block reads what an earlier one wrote), against a deployment of the
three services: one of its own for a document in ``OWN_DEPLOYMENT`` (so the step ids it sees come
from its own traffic only), one shared by the others (they read nothing a previous document's
traffic changes). In that folder ``.venv`` is this interpreter's virtual environment and ``PATH``
starts with its ``bin``, as after ``make install``.

Ports: the documents use the documented defaults, ``127.0.0.1`` or ``localhost`` with 50051
(prepare), 50052 (device), 50053 (reclaim), 9101-9103 (their metrics), 8000 (prepare's HTTP API); each is replaced by the
ephemeral port of the service started here, so the test never collides with a deployment on the
default ports. A command that dials a service names its address (``--target 127.0.0.1:50051``).

Markers, an HTML comment on the line directly above a block's opening fence (invisible when the
Markdown is rendered):

- ``<!-- docs-test: skip REASON -->``: not run, reported as skipped with REASON (it needs a
  cluster, Docker, a quiet machine for minutes, or serves until Ctrl-C);
- ``<!-- docs-test: expect-output -->``: the fenced block that follows is what this one prints:
  each of its non-empty lines must appear in the output (stdout and stderr); the exit status is
  not checked, so a documented error can be shown.

Blocks in other languages (``json``, ``text``, none) are examples of output or configuration and
are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from stageserve.launcher import Pipeline
from tests.integration.conftest import launch

ROOT = Path(__file__).resolve().parents[2]
OWN_DEPLOYMENT = {"observability.md"}  # its trace windows name step ids: they must count its own traffic only
# Those with a deployment of their own last, so the shared one starts once.
DOCUMENTS = sorted([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], key=lambda path: path.name in OWN_DEPLOYMENT)
RUNNERS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|expect-output)\b\s*(.*?)\s*-->$")
DEFAULT_PORTS = {"50051": ("prepare", "port"), "50052": ("device", "port"), "50053": ("reclaim", "port"),
                 "9101": ("prepare", "metrics_port"), "9102": ("device", "metrics_port"), "9103": ("reclaim", "metrics_port"),
                 "8000": ("prepare", "http_port")}
ADDRESS = re.compile(r"\b(127\.0\.0\.1|localhost):(" + "|".join(DEFAULT_PORTS) + r")\b")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced command block: where it is, what it says, how the document marks it."""

    document: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str  # "", "skip" or "expect-output"
    reason: str  # skip: why
    expected: str  # expect-output: the text of the next fenced block

    @property
    def id(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def command_blocks(document: Path) -> list[Block]:
    """The ``bash`` and ``python`` fenced blocks of ``document``, with their markers.

    Raises:
        AssertionError: a marker is unknown, or an ``expect-output`` block has no block after it.
    """
    text = document.read_text()
    lines = text.splitlines()
    fences = [token for token in MarkdownIt().parse(text) if token.type == "fence"]
    blocks = []
    for index, fence in enumerate(fences):
        language = fence.info.split()[0] if fence.info.strip() else ""
        above = lines[fence.map[0] - 1].strip() if fence.map[0] > 0 else ""
        marker = MARKER.match(above)
        if "docs-test" in above:
            assert marker, f"{document.name}:{fence.map[0]}: unknown docs-test marker {above!r}"
        if language not in RUNNERS:
            continue
        kind, reason = marker.groups() if marker else ("", "")
        expected = ""
        if kind == "expect-output":
            assert index + 1 < len(fences), f"{document.name}:{fence.map[0] + 1}: expect-output needs a block after it"
            expected = fences[index + 1].content
        blocks.append(Block(document, fence.map[0] + 1, language, fence.content, kind, reason, expected))
    return blocks


BLOCKS = [block for document in DOCUMENTS for block in command_blocks(document)]


def with_ports(text: str, pipeline: Pipeline) -> str:
    """``text`` with each documented default address replaced by the started service's."""
    def replace(match: re.Match) -> str:
        role, attribute = DEFAULT_PORTS[match.group(2)]
        port = getattr(getattr(pipeline, role), attribute)
        assert port, f"{role} serves no {attribute.replace('_', ' ')}"
        return f"{match.group(1)}:{port}"

    return ADDRESS.sub(replace, text)


class Deployments:
    """One scratch folder per document, and its deployment (see the module docstring); a
    deployment is stopped when the next one starts (so only one runs at a time)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._document: Path | None = None
        self._deployment = ""  # the running deployment's name: a document's stem, or "shared"
        self._pipeline: Pipeline | None = None
        self.folder: Path | None = None

    def for_document(self, document: Path) -> tuple[Pipeline, Path]:
        if document != self._document:
            self._document = document
            deployment = document.stem if document.name in OWN_DEPLOYMENT else "shared"
            if deployment != self._deployment:
                self.stop()
                self._deployment = deployment
                # bfloat16 where the CPU has it (the README's default): the documents' answers need no float32 match.
                self._pipeline = launch(self._factory, f"docs-{deployment}", device_args=["--dtype", "auto"], prepare_args=["--http-port", "0"])
            self.folder = self._factory.mktemp(f"docs-{document.stem}-cwd")
            (self.folder / ".venv").symlink_to(sys.prefix, target_is_directory=True)
        assert self._pipeline is not None and self.folder is not None
        return self._pipeline, self.folder

    def stop(self) -> None:
        if self._pipeline is not None:
            self._pipeline.stop()
            self._pipeline, self._deployment = None, ""


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory):
    started = Deployments(tmp_path_factory)
    try:
        yield started
    finally:
        started.stop()


def test_the_documents_have_command_blocks_and_markers_are_known():
    # command_blocks() asserts on unknown markers while BLOCKS is built; here: nothing was missed.
    assert {block.document.name for block in BLOCKS} >= {"README.md", "deploy.md", "observability.md"}
    assert any(block.marker == "" for block in BLOCKS if block.document.name == "README.md")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_command_block_runs(block: Block, deployments: Deployments):
    if block.marker == "skip":
        pytest.skip(block.reason or "marked docs-test: skip")
    pipeline, folder = deployments.for_document(block.document)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([*RUNNERS[block.language], with_ports(block.text, pipeline)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    output = done.stdout + done.stderr
    if block.marker == "expect-output":
        missing = [line.strip() for line in block.expected.splitlines() if line.strip() and line.strip() not in output]
        assert not missing, f"{block.id}: the output lacks {missing}; it was:\n{output[-3000:]}"
    else:
        assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{output[-3000:]}"
