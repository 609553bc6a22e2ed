"""The ``stageserve`` command line: one sub-command per service, plus ``up`` and ``generate``.

Each service package exposes ``add_arguments(parser)`` and ``run(args) -> int`` in its ``main``
module; this module only wires them to sub-commands, so ``stageserve device --help`` and the
Kubernetes manifests see exactly the flags the service defines.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module with add_arguments(parser) and run(args) -> int, and its one-line help.
COMMANDS = {
    "prepare": ("stageserve.prepare.main", "run the prepare service (public Generation API, scheduler)"),
    "device": ("stageserve.device.main", "run the device service (model, KV cache, async executor)"),
    "reclaim": ("stageserve.reclaim.main", "run the reclaim service (completion, detokenize, publish)"),
    "up": ("stageserve.launcher", "start all three services locally on the embedded model"),
    "generate": ("stageserve.client", "stream a generation from a running prepare service"),
    "trace": ("stageserve.trace_tools.main", "merge, analyze and plot the services' Chrome traces"),
    "bench": ("stageserve.bench.main", "load a prepare service and compare against baselines and peers"),
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every sub-command's flags)."""
    parser = argparse.ArgumentParser(prog="stageserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(module=module_name)
        importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stageserve`` console script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return importlib.import_module(args.module).run(args)


if __name__ == "__main__":
    sys.exit(main())
