"""Tool-call readers: a choice's text read into content and OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from stageserve.prepare.tool_calls import (TOOL_CALL_PARSERS, ArrayReader, HermesReader, NamedReader, forced_call_schema,
                                          pick_tool_call_parser, tool_call_reader)
from stageserve.v1 import prepare_pb2

WEATHER = prepare_pb2.Tool(name="get_weather", parameters=json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
TIME = prepare_pb2.Tool(name="get_time")
HERMES_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def streamed(reader, text: str, piece: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``piece`` characters, then finish; the content and deltas sent."""
    content, deltas = [], []
    for start in range(0, len(text), piece):
        more, calls = reader.feed(text[start:start + piece])
        content.append(more)
        deltas += calls
    more, calls = reader.finish()
    return "".join(content) + more, deltas + calls


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_calls_come_apart_from_the_content_however_the_text_is_split(piece):
    reader = HermesReader()
    content, deltas = streamed(reader, HERMES_TEXT, piece)
    assert content == "Let me check. "
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)
    assert reader.calls == [{k: v for k, v in d.items() if k != "index"} for d in deltas]


def test_hermes_gives_back_what_is_not_a_call():
    content, deltas = streamed(HermesReader(), "a < b and <tool_call>not json</tool_call> <tool", 2)
    assert deltas == [] and content == "a < b and <tool_call>not json</tool_call> <tool"
    content, deltas = streamed(HermesReader(), '<tool_call>{"name": "get_time", "arguments": {}}', 4)  # EOS before the close tag
    assert content == "" and deltas[0]["function"]["name"] == "get_time"


def test_forced_calls_are_sent_whole_and_a_cut_one_as_content():
    reader = NamedReader(name="get_weather")
    content, deltas = streamed(reader, '{"city": "Paris"}', 2)
    assert content == "" and [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [("get_weather", '{"city": "Paris"}')]
    assert streamed(NamedReader(name="get_weather"), '{"city": "Par', 2) == ('{"city": "Par', [])
    content, deltas = streamed(ArrayReader(), '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]', 5)
    assert content == "" and [d["function"]["name"] for d in deltas] == ["get_time", "get_weather"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_required_calls_stream_as_each_item_closes_and_a_cut_array_keeps_its_whole_calls(piece):
    first = '[ {"name": "get_time", "parameters": {"zone": "}, ["}}'
    reader = ArrayReader()
    sent = [reader.feed(first[start:start + piece])[1] for start in range(0, len(first), piece)]
    assert [d["function"]["name"] for deltas in sent for d in deltas] == ["get_time"]  # before the array ends
    content, deltas = streamed(ArrayReader(), first + ', {"name": "get_weather", "parameters": {"ci', piece)  # max_tokens
    assert content == "" and [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_time")]
    assert json.loads(deltas[0]["function"]["arguments"]) == {"zone": "}, ["}
    assert streamed(ArrayReader(), '[{"name": "get_wea', piece) == ('[{"name": "get_wea', [])  # no call completed


def test_the_forced_schema_admits_exactly_the_tools_calls():
    schema = json.loads(forced_call_schema([WEATHER, TIME], None, parallel=True))
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(forced_call_schema([WEATHER, TIME], None, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    assert forced_call_schema([WEATHER, TIME], "get_weather", parallel=True) == WEATHER.parameters


def test_reader_by_tool_choice():
    assert tool_call_reader([], "auto") is None and tool_call_reader([WEATHER], "none") is None
    assert isinstance(tool_call_reader([WEATHER], "auto"), HermesReader)
    assert isinstance(tool_call_reader([WEATHER], "required"), ArrayReader)
    assert tool_call_reader([WEATHER], "get_weather").name == "get_weather"


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}};{"name": "get_time", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama3_and_mistral_calls(parser, text, piece):
    content, deltas = streamed(TOOL_CALL_PARSERS[parser](), text, piece)
    assert content == "" and [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_leading_json_readers_stream_plain_answers_and_give_back_broken_calls(parser):
    reader = TOOL_CALL_PARSERS[parser]()
    assert reader.feed("The weather")[0] == "The weather" and reader.feed(" is fine.") == (" is fine.", [])
    broken = "[TOOL_CALLS][{" if parser == "mistral" else '{"name": "get_we'
    assert streamed(TOOL_CALL_PARSERS[parser](), broken, 3) == (broken, [])


def test_the_parser_is_picked_by_the_template():
    assert pick_tool_call_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert pick_tool_call_parser("auto", "[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert pick_tool_call_parser("auto", "<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert pick_tool_call_parser("auto", None) == "hermes" and pick_tool_call_parser("mistral", "<tool_call>") == "mistral"
