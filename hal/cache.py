"""Where rlt-hal keeps what it makes on first use: toy checkpoints, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "RLT_HAL_CACHE"


def cache_dir() -> Path:
    """``$RLT_HAL_CACHE``, default ~/.cache/rlt-hal; whoever writes into it creates it."""
    return Path(os.environ.get(CACHE_ENV_VAR, Path.home() / ".cache" / "rlt-hal"))
