"""moe_mnist / moe_cifar10: tiny files in the real on-disk formats (MNIST idx, gzipped or not; CIFAR-10
python batches) go through the examples' loaders and one training epoch; without data they say where
to get it; scikit-learn's 8x8 digits reach >= 90% test accuracy."""
import gzip
import pickle
import struct

import pytest
import torch

from dynamoe.examples import _vision, moe_cifar10, moe_mnist


def write_idx(path, t: torch.Tensor, compress: bool = False) -> None:
    """The idx format: 0x0000 08 ndim, big-endian int32 dims, unsigned bytes."""
    header = struct.pack(">HBB", 0, 0x08, t.dim()) + struct.pack(f">{t.dim()}I", *t.shape)
    data = header + t.to(torch.uint8).numpy().tobytes()
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as f:
        f.write(data)


def _images(n: int, shape, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)


@pytest.fixture
def mnist_dir(tmp_path):
    for i, (split, n) in enumerate((("train", 24), ("t10k", 10))):
        x, y = _images(n, (28, 28), i)
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", x, compress=True)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", y)
    return tmp_path


@pytest.fixture
def cifar_dir(tmp_path):
    np = pytest.importorskip("numpy")
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate(_vision.CIFAR_FILES):
        x, y = _images(4, (3, 32, 32), i)
        with open(folder / name, "wb") as f:  # as the real archive: numpy uint8 [N, 3072], a list of labels
            pickle.dump({b"batch_label": name.encode(), b"labels": y.tolist(),
                         b"data": np.asarray(x.reshape(4, -1).numpy()), b"filenames": [b"x.png"] * 4}, f)
    return tmp_path


def test_idx_round_trip_and_bad_files(tmp_path):
    x, _ = _images(3, (28, 28), 0)
    write_idx(tmp_path / "a", x)
    write_idx(tmp_path / "b.gz", x, compress=True)
    assert torch.equal(_vision.read_idx(str(tmp_path / "a")), x)
    assert torch.equal(_vision.read_idx(str(tmp_path / "b.gz")), x)
    (tmp_path / "c").write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x01\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="not an unsigned-byte idx file"):
        _vision.read_idx(str(tmp_path / "c"))
    (tmp_path / "d").write_bytes(struct.pack(">HBBI", 0, 8, 1, 5) + b"\x01\x02")
    with pytest.raises(ValueError, match="header says"):
        _vision.read_idx(str(tmp_path / "d"))


def test_mnist_loader_and_one_epoch(mnist_dir, capsys):
    tx, ty, vx, vy = _vision.load_mnist(str(mnist_dir))
    assert tx.shape == (24, 1, 28, 28) and ty.shape == (24,) and vx.shape == (10, 1, 28, 28)
    assert torch.equal(tx[:, 0], _images(24, (28, 28), 0)[0])
    hist = moe_mnist.main(["--data", str(mnist_dir), "--epochs", "1", "--batch-size", "8", "--hidden-size", "16"])
    assert len(hist["test_accuracy"]) == 1 and 0.0 <= hist["test_accuracy"][0] <= 1.0
    assert "Test set: Average loss" in capsys.readouterr().out


def test_cifar_loader_and_one_epoch(cifar_dir):
    tx, ty, vx, vy = _vision.load_cifar10(str(cifar_dir))
    assert tx.shape == (20, 3, 32, 32) and ty.shape == (20,) and vx.shape == (4, 3, 32, 32)
    assert torch.equal(tx[:4], _images(4, (3, 32, 32), 0)[0])
    hist = moe_cifar10.main(["--data", str(cifar_dir / "cifar-10-batches-py"), "--epochs", "1", "--batch-size", "8",
                             "--hidden-size", "16"])
    assert len(hist["test_accuracy"]) == 1


@pytest.mark.parametrize("module, where", [(moe_mnist, "t10k-images-idx3-ubyte"), (moe_cifar10, "cifar-10-python")])
def test_no_data_says_where_to_get_it(module, where, tmp_path):
    for argv in ([], ["--data", str(tmp_path)]):
        with pytest.raises(SystemExit, match=where) as e:
            module.main(argv)
        assert "--dataset digits" in str(e.value)


def test_digits_quick():
    """A short digits run (the default run is the slow test below) already passes 90%."""
    hist = moe_mnist.main(["--dataset", "digits", "--epochs", "3"])
    assert max(hist["test_accuracy"]) >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("module", [moe_mnist, moe_cifar10])
def test_digits_default_run(module):
    """The example's default run (up to a minute on 2 busy cores): `pytest -m slow`."""
    hist = module.main(["--dataset", "digits"])
    assert hist["test_accuracy"][-1] >= 0.90
