"""structlog set-up: one key=value line per event on stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _Stderr:
    """Looks sys.stderr up at each write, so redirections made later (pytest, daemons) are followed."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = (level or os.environ.get("LLMSERVE_LOG_LEVEL", "INFO")).upper()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=True,
    )
