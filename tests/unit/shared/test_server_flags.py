"""The flags every service shares, defined once in ``stageserve.server.add_service_arguments``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stageserve.cli import build_parser
from stageserve.server import add_service_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, default_port=50099, default_metrics_port=9199)
    return parser.parse_args(argv)


def test_defaults():
    args = parse()
    assert (args.host, args.port, args.port_file, args.log_level, args.log_format) == ("127.0.0.1", 50099, None, "INFO", "text")
    assert (args.drain_timeout, args.trace_dir, args.metrics_port) == (30.0, None, 9199)


@pytest.mark.parametrize("value, expected", [("0", 0), ("9300", 9300), ("off", None), ("OFF", None)])
def test_metrics_port_ephemeral_fixed_or_off(value, expected):
    assert parse("--metrics-port", value).metrics_port == expected


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--metrics-port", "-1"], ["--log-format", "xml"], ["--drain-timeout", "-2"]])
def test_bad_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_log_level_is_case_insensitive():
    assert parse("--log-level", "debug", "--trace-dir", "t").log_level == "DEBUG"
    assert parse("--trace-dir", "t").trace_dir == Path("t")


@pytest.mark.parametrize("role, port, metrics_port", [("prepare", 50051, 9101), ("device", 50052, 9102), ("reclaim", 50053, 9103)])
def test_every_service_has_the_common_flags_with_its_own_ports(role, port, metrics_port):
    args = build_parser().parse_args([role])
    assert (args.port, args.metrics_port, args.log_format, args.trace_dir) == (port, metrics_port, "text", None)


def every_parser(parser: argparse.ArgumentParser, prog: str = "stageserve"):
    """``(prog, parser)`` for ``parser`` and each of its sub-commands, depth first."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from every_parser(child, f"{prog} {name}")


def test_every_command_renders_its_help():
    """``--help`` formats each flag's text with ``%``: a literal percent sign must be written ``%%``
    (``stageserve device --help`` once failed with "%o format: an integer is required")."""
    parsers = dict(every_parser(build_parser()))
    assert {"stageserve device", "stageserve up", "stageserve bench"} <= set(parsers)
    for prog, parser in parsers.items():
        text = parser.format_help()
        assert "usage:" in text, prog
    assert "at most 25% of the available memory" in " ".join(parsers["stageserve device"].format_help().split())
