"""structlog setup shared by every long-running command.

JSON lines when stderr is not a terminal (collectors parse them), coloured
key=value lines on a terminal. Every line names its component (`component`: the
module family that wrote it, `llmgw.router`, `aiohttp.access`, `nats.aio.client`):
llmgw's own loggers carry the name given to `get`, and records of the standard
library's logging (aiohttp, nats-py, asyncio) go through the same processors and
renderer, so a collector sees one format, never plain text inside the JSON stream.
Secrets are never passed to a logger.
"""

from __future__ import annotations

import contextvars
import logging
import sys

import structlog

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
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
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
