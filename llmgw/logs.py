"""structlog setup shared by every long-running command.

JSON lines when stderr is not a terminal (collectors parse them), coloured
key=value lines on a terminal. Every line names its component (`component`: the
module family that wrote it, `llmgw.router`, `aiohttp.access`, `nats.aio.client`):
llmgw's own loggers carry the name given to `get`, and records of the standard
library's logging (aiohttp, nats-py, asyncio) go through the same processors and
renderer, so a collector sees one format, never plain text inside the JSON stream.
Secrets are never passed to a logger.

Fields quote what nodes, routers and clients wrote (a refused event's error, a node's
name, a request line): on a terminal every key and text is escaped as `llmgw ctl`
escapes it (llmgw.core.printable), so none can drive the terminal or forge a line. The
JSON lines need nothing more: Python's JSON writes every character but printable ASCII
as an escape.
"""

from __future__ import annotations

import contextvars
import logging
import sys

import structlog

from llmgw.core import printable

TRACE: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("llmgw_trace")
"""The trace (and span) of the request being served, for every line it logs: one
variable set per request, cheaper than binding two of structlog's own; empty ids are
left out."""


def setup(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog and the standard library's logging to one format."""
    as_json = (not sys.stderr.isatty()) if json is None else json
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else EscapingConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        _trace_of_request,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _component_of_record],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)


class EscapingConsoleRenderer(structlog.dev.ConsoleRenderer):
    """structlog's console renderer, over the event's keys and values escaped."""

    def __call__(
        self,
        logger: structlog.typing.WrappedLogger,
        name: str,
        event_dict: structlog.typing.EventDict,
    ) -> str:
        shown = {printable.escaped(str(k)): _shown(k, v) for k, v in event_dict.items()}
        return super().__call__(logger, name, shown)


class _Shown(str):
    """A value as the console writes it, escaped and quoted already: the renderer takes
    the repr of text that holds a space or a quote, which would double its backslashes."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


_MULTILINE = ("exception", "stack")
"""Tracebacks: each of their lines is escaped and indented (`_INDENT`), and they keep their
line breaks."""
_INDENT = "  "
"""Before each line of a traceback: an exception's message may hold a node's text, line
breaks included, and no line of it may start where a log line does (its date)."""

_QUOTED_IF = frozenset(" =\"'")
"""What makes the renderer quote a text (tabs and line breaks are escaped by then)."""


def _shown(key: object, value: object) -> object:
    """`value` of field `key` as the renderer is to write it."""
    if key == "exc_info" or value is None or isinstance(value, bool | int | float):
        # Numbers' reprs are safe; exc_info is a flag by now (format_exc_info, before the
        # renderer, has written the traceback out as `exception`).
        return value
    if not isinstance(value, str):
        return _Shown(printable.escaped(repr(value)))
    if key in _MULTILINE:
        return "\n".join(_INDENT + printable.escaped(line) for line in value.split("\n"))
    text = printable.escaped(value)
    if key == "event" or _QUOTED_IF.isdisjoint(text):
        return text
    quote = '"' if "'" in text else "'"
    # A quote inside would end the value early, and what follows it read as fields of
    # their own: escaped, as a backslash (doubled by now) cannot be mistaken for it.
    inner = text.replace(quote, "\\" + quote)
    return _Shown(f"{quote}{inner}{quote}")


def _trace_of_request(
    _logger: object, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    trace = TRACE.get(None)
    if trace is not None:
        event_dict["trace_id"] = trace[0]
        if trace[1]:
            event_dict["span_id"] = trace[1]
    return event_dict


def _component_of_record(
    _logger: object, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """A standard library record's logger name, as llmgw's own lines carry theirs."""
    record = event_dict.get("_record")
    if record is not None:
        event_dict["component"] = record.name
    return event_dict


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger whose every line carries `component=name` (bound when first used, so
    that module-level loggers take the configuration `setup` makes later)."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name, component=name)
    return logger
