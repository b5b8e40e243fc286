"""Writing a file so that a crash never leaves a torn one: a temporary file in the same folder,
flushed to disk, then renamed over the target."""
from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["save_atomic"]


def save_atomic(obj, path: str) -> None:
    """``torch.save(obj, path)``, atomically: readers see the old file or the new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
