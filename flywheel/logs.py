"""One log format for every service: time, service, pid, level, message."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format=f"%(asctime)s {service}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
