"""The package logger: `pagellm` at INFO with a compact format, unless the application configured logging."""
import logging

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("pagellm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)
