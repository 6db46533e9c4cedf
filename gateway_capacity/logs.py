"""Log lines of the long-running commands (``sidecar``, ``router serve``).

``--log-format text`` (default): ``2026-12-01T02:03:04.123Z WARNING message``;
``--log-format json``: one JSON object a line, ``{"ts": "2026-12-01T02:03:04.123Z",
"level": "warning", "logger": ..., "msg": ...}`` plus the structured fields a
record carries (``provider``, ``limit``, ``source``) and ``exception`` for a
traceback. Timestamps are RFC 3339 in UTC with milliseconds, so lines from
hosts in different zones sort and join as they are. Both go to stderr
(journald, a container runtime or the supervisor keeps them). A text line's message
has its control characters escaped (``\\n``, ``\\x1b``): a worker's words can forge no
line and move no cursor; JSON escapes them itself.

No key ever reaches a log: the modules that handle keys never log them, and
httpx/httpcore, which log URLs and headers, are kept at WARNING (R-P7).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final

from capacity_contract import shown

FORMATS: Final = ("text", "json")
LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
# structured fields a record may carry (``extra=``), copied into JSON lines
FIELDS: Final = ("provider", "limit", "source")


def rfc3339(created: float) -> str:
    """``created`` (Unix seconds) as RFC 3339 UTC with milliseconds: ``...T02:03:04.123Z``."""
    stamp = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        # one record, one line: what a worker or a router said is escaped (capacity_contract)
        message = shown(record.getMessage())
        line = f"{rfc3339(record.created)} {record.levelname} {self.prefix}{message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in FIELDS:
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(fmt: str = "text", level: str = "INFO", *, prefix: str = "") -> None:
    """Send every logger to stderr in ``fmt``; ``prefix`` starts each text message."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(prefix))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore"):  # they log URLs and headers (R-P7)
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_log_options(parser: Any) -> None:
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text (default) or json: one object a line; RFC 3339 UTC timestamps either way",
    )
    parser.add_argument("--log-level", default="INFO", choices=LEVELS)
