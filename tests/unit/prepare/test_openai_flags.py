"""The OpenAI API's flags: what ``stageserve up`` passes on is what prepare parses back."""

from __future__ import annotations

import argparse

import pytest

from stageserve.prepare.openai_flags import add_openai_arguments, openai_argv


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_openai_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [
    [],
    ["--reasoning-parser", "qwen3", "--served-model-name", "smol", "alias", "--chat-template", "t.jinja"],
])
def test_the_flags_given_are_passed_on_unchanged(argv):
    given = parse(argv)
    assert parse(openai_argv(given)) == given
