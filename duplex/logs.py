"""Logging for the server and its stage processes: one format, with the session id on every line
that has one (``LoggerAdapter(log, {"session_id": ...})``) and ``-`` elsewhere."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s [%(session_id)s] %(message)s"


class _DefaultSession(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session_id"):
            record.session_id = "-"
        return True


def setup_logging() -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_DefaultSession())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("DUPLEX_LOG_LEVEL", "INFO"))
