"""Log line formats: text with a request-id tag, JSON one object per line."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from stageserve.logs import REQUEST_ID, JsonFormatter, TextFormatter
from stageserve.server import configure_logging


def record(message: str = "step %d done", args: tuple = (7,), **extra) -> logging.LogRecord:
    rec = logging.LogRecord("stageserve.prepare.api", logging.INFO, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_text_line_names_level_logger_and_request_id():
    line = TextFormatter().format(record(request_id="req-1"))
    assert line.endswith(" INFO stageserve.prepare.api: step 7 done [request_id=req-1]")


def test_text_line_without_request_has_no_tag():
    assert "request_id" not in TextFormatter().format(record())


def test_json_line_has_the_documented_keys():
    line = json.loads(JsonFormatter("prepare").format(record(request_id="req-1")))
    assert line["level"] == "INFO" and line["service"] == "prepare" and line["logger"] == "stageserve.prepare.api"
    assert line["message"] == "step 7 done" and line["request_id"] == "req-1"
    assert line["time"].endswith("Z") and "T" in line["time"]


def test_json_line_keeps_a_traceback_in_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), exc_info=sys.exc_info())
    text = JsonFormatter("device").format(rec)
    assert "\n" not in text
    assert "ValueError: boom" in json.loads(text)["exception"]
    assert "request_id" not in json.loads(text)


def test_a_logger_adapter_tags_every_line(caplog):
    with caplog.at_level(logging.INFO):
        logging.LoggerAdapter(logging.getLogger("stageserve.test"), {REQUEST_ID: "abc"}).info("hello")
    assert TextFormatter().format(caplog.records[-1]).endswith("hello [request_id=abc]")


def test_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="--log-format 'xml'"):
        configure_logging("INFO", "xml", "prepare")
