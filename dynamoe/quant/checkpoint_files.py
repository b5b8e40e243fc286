"""Hugging Face checkpoint folders as tensors: a lazy name -> tensor mapping over single-file or
sharded safetensors, and a writer that emits one tensor at a time (memory ~ one tensor)."""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import shutil
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


__all__ = ["CheckpointTensors", "SafetensorsWriter", "release_unreferenced_pages"]

log = logging.getLogger(__name__)


# ============================================================================ files
class CheckpointTensors(Mapping):
    """A lazy ``name -> Tensor`` mapping over a Hugging Face folder (``model.safetensors``, or shards
    listed by ``model.safetensors.index.json``): files are memory-mapped, tensors read on access."""

    def __init__(self, path):
        from safetensors import safe_open

        self._open = safe_open
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        self.where: dict = {}
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            for file in dict.fromkeys(weight_map.values()):
                if not os.path.exists(os.path.join(self.path, file)):
                    raise ValueError(f"{index} lists {file!r}, which is not in {self.path}")
            self.files = list(dict.fromkeys(weight_map.values()))
            for file in self.files:  # the files' own key lists, in file order (the index may be unordered)
                for k in self._handle(file).keys():
                    self.where.setdefault(k, file)
            missing = [k for k in weight_map if k not in self.where]
            if missing:
                raise ValueError(f"{index} lists tensors missing from the shards, e.g. {missing[0]!r}")
        elif os.path.exists(single):
            self.files = ["model.safetensors"]
            self.where = {k: "model.safetensors" for k in self._handle("model.safetensors").keys()}
        else:
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {self.path}")

    _handles: dict

    def _handle(self, file: str):
        handles = self.__dict__.setdefault("_handles", {})
        if file not in handles:
            handles[file] = self._open(os.path.join(self.path, file), framework="pt")
        return handles[file]

    def names_in(self, file: str) -> list:
        return [k for k, f in self.where.items() if f == file]

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.where:
            raise KeyError(name)
        return self._handle(self.where[name]).get_tensor(name)

    def get_slice(self, name: str):
        """safetensors' lazy view of tensor ``name``: ``.get_shape()``, and ``[a:b]`` reads those rows only."""
        if name not in self.where:
            raise KeyError(name)
        return self._handle(self.where[name]).get_slice(name)

    def __contains__(self, name) -> bool:
        return name in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def close(self) -> None:
        self.__dict__.get("_handles", {}).clear()

    def file_paths(self) -> list[str]:
        return [os.path.realpath(os.path.join(self.path, f)) for f in self.files]


def _file_mappings(paths: set[str]) -> tuple[list[tuple[int, int]], int]:
    """The (start, end) addresses of this process's mappings of the files ``paths`` that hold no page of their
    own, and the bytes of them resident (Linux: /proc/self/smaps, ``Anonymous: 0 kB``, ``Rss``). torch maps
    safetensors files private and writable: a page written to would be the process's own copy, and dropping it
    would lose the write -- such mappings are left out whole."""
    out, resident, current, rss = [], 0, None, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:   # a mapping's first line
                current = None
                if len(head) == 6 and head[5].rstrip("\n") in paths:
                    current = tuple(int(x, 16) for x in head[0].split("-"))
            elif current is not None and line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif current is not None and line.startswith("Anonymous:"):
                if int(line.split()[1]) == 0:
                    out.append(current)
                    resident += rss
                current = None
    return out, resident


def _span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a CPU tensor can read (strides are never negative in torch)."""
    a = t.data_ptr()
    if t.numel() == 0:
        return a, a
    return a, a + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def release_unreferenced_pages(paths: Iterable[str], tensors: Iterable[Tensor]) -> int:
    """Drop from this process's resident memory the pages of the memory-mapped checkpoint files ``paths`` that
    none of ``tensors`` (the loaded model's parameters and buffers) points into; returns the resident bytes that
    left.

    safetensors maps each file and hands out tensors that read it in place. A model keeps some of them as they are
    (their pages stay mapped, read on use) and copies others while loading (de-interleaved, stacked, converted):
    the source pages of a copy were read once and stay mapped, counted in the process's resident set (a 13.8 GB
    gpt-oss-20b showed 7.7 GB of such dead pages beside 7.7 GB of its own memory) and competing with the weights
    in use for the page cache. ``madvise(MADV_DONTNEED)`` unmaps them from the process (a clean file page: nothing
    is lost, the file stays as it is; a later read would fault it in again). Only whole pages inside a live
    mapping of one of the files that the process never wrote to are touched. Where /proc/self/smaps or madvise is
    missing: nothing, 0."""
    paths = {os.path.realpath(p) for p in paths}
    if not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    maps, resident = _file_mappings(paths)
    if not maps:
        return 0
    kept = sorted(_span(t) for t in tensors if t.device.type == "cpu" and any(s <= t.data_ptr() < e for s, e in maps))

    def drop(lo: int, hi: int) -> None:   # the whole pages in [lo, hi)
        lo, hi = -(-lo // page) * page, hi // page * page
        if hi > lo and libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on a checkpoint mapping")

    try:
        for start, end in maps:
            pos = start
            for a, b in kept:
                if b <= pos:
                    continue
                if a >= end:
                    break
                drop(pos, a)
                pos = max(pos, b)
            drop(pos, end)
    except OSError as exc:
        log.warning("dynamoe: could not release unused checkpoint pages (%s)", exc)
    return max(0, resident - _file_mappings(paths)[1])


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
for _name, _code in (("float8_e8m0fnu", "F8_E8M0"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time (memory: one tensor): data goes to a side file
    as it comes, the header is written on :meth:`close`."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._data_path = self.path + ".data.tmp"
        self._data = open(self._data_path, "wb")
        self.entries: dict = {}
        self.nbytes = 0

    def add(self, name: str, t: Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name!r} written twice to {self.path}")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors encoding")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self._data.write(raw.data)
        self.entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.nbytes, self.nbytes + raw.size]}
        self.nbytes += raw.size

    def close(self) -> None:
        self._data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
        os.remove(self._data_path)

    def abort(self) -> None:
        self._data.close()
        if os.path.exists(self._data_path):
            os.remove(self._data_path)
