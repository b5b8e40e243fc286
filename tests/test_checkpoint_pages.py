"""Checkpoint pages a loaded model does not read in place leave the process's resident set
(dynamoe.quant.checkpoint_files.release_unreferenced_pages): the tensors kept in place keep their pages and values,
copied tensors' sources are unmapped (and read back intact if read again), and a mapping the process wrote into is
left alone (dropping a written private page would lose the write)."""
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from dynamoe.quant.checkpoint_files import CheckpointTensors, release_unreferenced_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")

MB = 1 << 20


def _resident_of(path: str) -> int:
    """Resident bytes of this process's mappings of ``path``."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
                current = len(head) == 6 and head[5].strip() == path
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = {name: torch.randn(MB // 4, generator=g) for name in ("a", "b", "c")}   # 1 MiB each
    save_file(data, os.path.join(tmp_path, "model.safetensors"))
    return str(tmp_path), data


def test_pages_of_copied_tensors_leave_and_kept_ones_stay(checkpoint):
    folder, data = checkpoint
    files = CheckpointTensors(folder)
    path = files.file_paths()[0]
    a = files["a"]                          # kept in place, as a model keeps most weights
    b = files["b"].clone()                  # copied (de-interleaved, stacked, converted...): its source is dead
    assert float(a.sum()) == pytest.approx(float(data["a"].sum()), rel=1e-5)
    assert float(files["c"].sum()) == pytest.approx(float(data["c"].sum()), rel=1e-5)   # read once, not kept
    before = _resident_of(path)
    assert before >= 3 * MB
    released = release_unreferenced_pages([path], [a, b])
    after = _resident_of(path)
    assert released == before - after >= 2 * MB - 3 * 4096      # b's and c's pages (but partial ones at a's ends)
    assert after <= 1 * MB + 2 * 4096
    assert torch.equal(a, data["a"]) and torch.equal(b, data["b"])
    assert torch.equal(files["c"], data["c"])                   # a dropped page reads back from the file
    files.close()


def test_a_mapping_written_to_is_left_whole(checkpoint):
    folder, data = checkpoint
    files = CheckpointTensors(folder)
    path = files.file_paths()[0]
    a = files["a"]
    a[:10] = 7.0                            # torch maps the file private and writable: this page is ours now
    float(files["c"].sum())
    assert release_unreferenced_pages([path], [a]) == 0
    assert torch.equal(a[:10], torch.full((10,), 7.0)) and torch.equal(a[10:], data["a"][10:])
    files.close()


def test_nothing_to_do_without_a_mapping(tmp_path):
    assert release_unreferenced_pages([os.path.join(tmp_path, "absent.safetensors")], [torch.ones(3)]) == 0
