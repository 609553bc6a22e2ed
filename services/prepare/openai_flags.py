"""The OpenAI-compatible API's command-line flags, stated once for ``stageserve prepare`` and
``stageserve up`` (which passes them on to the prepare it starts). Light: the launcher reads them
without importing the HTTP stack."""

from __future__ import annotations

import argparse

from stageserve.prepare.reasoning import REASONING_PARSERS
from stageserve.prepare.tool_calls import TOOL_CALL_PARSERS


def add_openai_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``, ``--reasoning-parser``, ``--served-model-name``, ``--chat-template``."""
    parser.add_argument("--tool-call-parser", choices=["auto", *sorted(TOOL_CALL_PARSERS)], default="auto",
                        help="how the OpenAI API reads the model's own tool calls (tool_choice auto): hermes = "
                             "<tool_call>{json}</tool_call> (Qwen, Hermes), llama3_json, mistral = [TOOL_CALLS]; "
                             "auto = the one the chat template names, else hermes (default: %(default)s)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split chat answers into reasoning_content (the <think> text) and content: qwen3 = the model "
                             "writes <think>...</think>; deepseek_r1 = the template opened <think> (default: not split)")
    parser.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                        help="the names clients use for the model (the first is shown by GetModelInfo and /v1/models; "
                             "requests may use any; default: the model file's name)")
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="a Jinja chat template to use instead of the model's own (default: the model's)")


def openai_argv(args: argparse.Namespace) -> list[str]:
    """The flags of :func:`add_openai_arguments` that ``args`` sets, as a command line gives them."""
    argv = ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        argv += ["--reasoning-parser", args.reasoning_parser]
    if args.served_model_name:
        argv += ["--served-model-name", *args.served_model_name]
    if args.chat_template:
        argv += ["--chat-template", args.chat_template]
    return argv
