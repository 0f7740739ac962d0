"""Verbose logging by tag, as NNAPI's ``debug.nn.vlog`` property.

``NNRT_VLOG`` holds a comma/space/colon separated list of tags
(compilation, cpuexe, driver, execution, manager, model) or ``1``/``all``.
Each tag logs through the standard logger ``nnrt.<tag>`` at DEBUG level, so
applications can also route it with ordinary logging configuration.
"""
from __future__ import annotations

import logging
import os
import re

TAGS = ("compilation", "cpuexe", "driver", "execution", "manager", "model")


def _enabled_tags(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    words = {w for w in re.split(r"[,\s:]+", value.strip().lower()) if w}
    if words & {"1", "all"}:
        return frozenset(TAGS)
    unknown = words - set(TAGS)
    if unknown:
        logging.getLogger("nnrt").warning("NNRT_VLOG: unknown tags %s", sorted(unknown))
    return frozenset(words & set(TAGS))


_ENABLED = _enabled_tags(os.environ.get("NNRT_VLOG"))
_handler_installed = False


def on(tag: str) -> bool:
    """True when ``tag`` is enabled; check it before building an expensive message."""
    return tag in _ENABLED


def vlog(tag: str, msg: str, *args) -> None:
    if tag not in _ENABLED:
        return
    global _handler_installed
    logger = logging.getLogger(f"nnrt.{tag}")
    if not _handler_installed and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logging.getLogger("nnrt").addHandler(handler)
        logging.getLogger("nnrt").setLevel(logging.DEBUG)
        _handler_installed = True
    logger.debug(msg, *args)
