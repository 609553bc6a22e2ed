"""Every ``stageserve`` process (``python -m stageserve`` / the console script) runs with gRPC's fork
handlers off, set before grpc loads, unless the operator set them: its processes fork only to exec,
where those handlers can crash the child (grpc/grpc#43055)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import os, stageserve.cli, grpc; from grpc._cython import cygrpc; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'], cygrpc._GRPC_ENABLE_FORK_SUPPORT)"


def probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    return subprocess.run([sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, check=True).stdout.strip()


def test_the_command_line_turns_grpcs_fork_handlers_off_before_grpc_loads():
    assert probe() == "false False"


def test_an_operators_own_setting_is_kept():
    assert probe(GRPC_ENABLE_FORK_SUPPORT="true") == "true True"
