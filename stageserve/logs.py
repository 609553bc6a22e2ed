"""Log line formats of the services (``--log-format text|json``) and the request-id tag.

- ``text`` (default): ``TIME LEVEL LOGGER: MESSAGE``, plus ``[request_id=ID]`` on lines about a
  request; for people reading a terminal.
- ``json``: one JSON object per line with ``time`` (ISO 8601, UTC, ms), ``level``, ``service``,
  ``logger``, ``message``, ``request_id`` (lines about a request only) and ``exception`` (the
  formatted traceback, when there is one); for log collectors.

A line is about a request when its record has a ``request_id`` attribute: pass
``extra={REQUEST_ID: request_id}``, or log through ``logging.LoggerAdapter(logger, {REQUEST_ID: request_id})``.
"""

from __future__ import annotations

import json
import logging
import time

LOG_FORMATS = ("text", "json")
REQUEST_ID = "request_id"  # the LogRecord attribute that marks a line about a request


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE [request_id=ID]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, REQUEST_ID, None)
        if request_id is None:
            return line
        first, newline, rest = line.partition("\n")  # keep a traceback below the tagged line
        return f"{first} [request_id={request_id}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for the keys).

    Args:
        service: the ``service`` value of every line (``prepare``, ``device``, ``reclaim``).
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": _iso_utc(record.created),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, REQUEST_ID, None)
        if request_id is not None:
            line[REQUEST_ID] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _iso_utc(created: float) -> str:
    seconds = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"
