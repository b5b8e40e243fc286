"""Shared pieces of ``moe_mnist`` and ``moe_cifar10`` (Tutel's image examples): readers for the
standard on-disk formats, scikit-learn's bundled 8x8 digits, the small conv + MoE classifiers, and the
train / test loop (Adadelta with a step decay, as Tutel's).

Formats:

* MNIST: the four idx files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``), in ``--data`` or in
  its ``MNIST/raw`` (torchvision's layout). idx: big-endian magic ``0x0000080N`` (N dims, unsigned
  bytes), N big-endian int32 sizes, then the bytes.
* CIFAR-10: the python batches ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` (pickles of
  ``{b'data': uint8 [N, 3072] (R, G, B planes of 32x32), b'labels': [N]}``), in ``--data`` or in its
  ``cifar-10-batches-py`` (the archive's folder).
* digits: ``sklearn.datasets.load_digits`` (1797 8x8 images, shipped inside scikit-learn), split 80/20
  with a fixed permutation.

Legend: N images, C channels, H x W pixels.
"""
from __future__ import annotations

import argparse
import gzip
import os
import pickle
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..moe import moe_layer

__all__ = ["read_idx", "load_mnist", "load_cifar10", "load_digits", "ImageMoENet", "build_parser", "run",
           "MNIST_FILES", "CIFAR_FILES", "MNIST_HELP", "CIFAR_HELP"]

MNIST_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
               "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
MNIST_HELP = ("MNIST is not bundled. Download the four files train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
              "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (e.g. from a mirror of Yann LeCun's MNIST page, "
              "or any torchvision MNIST/raw folder) into a folder and pass --data FOLDER. Or run with --dataset digits "
              "(scikit-learn's bundled 8x8 digits: no download).")
CIFAR_HELP = ("CIFAR-10 is not bundled. Download cifar-10-python.tar.gz from Alex Krizhevsky's CIFAR page "
              "(https://www.cs.toronto.edu/~kriz/cifar.html), unpack it, and pass --data with the folder "
              "cifar-10-batches-py (or its parent). Or run with --dataset digits (scikit-learn's bundled 8x8 digits: "
              "no download).")

_IDX_DTYPES = {0x08: torch.uint8}


# ------------------------------------------------------------------------------------ readers
def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_idx(path: str) -> Tensor:
    """An idx file (optionally gzipped) as a uint8 tensor of its dims."""
    with _open(path) as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: not an idx file (only {len(data)} bytes)")
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype not in _IDX_DTYPES or ndim < 1:
        raise ValueError(f"{path}: not an unsigned-byte idx file (magic {data[:4].hex()}, expected 000008NN)")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = data[4 + 4 * ndim:]
    n = 1
    for d in dims:
        n *= d
    if len(body) != n:
        raise ValueError(f"{path}: header says {dims} = {n} bytes, file has {len(body)}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


def _find(folder: str, name: str, subdirs: tuple) -> str | None:
    for sub in ("",) + subdirs:
        for ext in ("", ".gz"):
            p = os.path.join(folder, sub, name + ext)
            if os.path.isfile(p):
                return p
    return None


def load_mnist(folder: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x uint8 [N, 1, 28, 28], train_y int64 [N], test_x, test_y) from MNIST's idx files."""
    paths = {k: _find(folder, v, ("MNIST/raw", "raw")) for k, v in MNIST_FILES.items()}
    missing = [MNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} (or .gz) in {folder!r}. {MNIST_HELP}")
    out = []
    for split in ("train", "test"):
        x, y = read_idx(paths[f"{split}_x"]), read_idx(paths[f"{split}_y"])
        if x.dim() != 3 or y.dim() != 1 or x.size(0) != y.size(0):
            raise ValueError(f"MNIST {split}: images {tuple(x.shape)} and labels {tuple(y.shape)} do not match "
                             "(expected [N, H, W] and [N])")
        out += [x.unsqueeze(1), y.long()]
    return tuple(out)


def load_cifar10(folder: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x uint8 [N, 3, 32, 32], train_y int64 [N], test_x, test_y) from CIFAR-10's python batches."""
    import numpy  # the batches are pickled numpy arrays

    paths = {n: _find(folder, n, ("cifar-10-batches-py",)) for n in CIFAR_FILES}
    missing = [n for n, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)} in {folder!r}. {CIFAR_HELP}")

    def read(names):
        xs, ys = [], []
        for n in names:
            with _open(paths[n]) as f:
                d = pickle.load(f, encoding="bytes")
            if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
                raise ValueError(f"{paths[n]}: not a CIFAR-10 python batch (a dict with b'data' and b'labels')")
            data = numpy.asarray(d[b"data"], dtype=numpy.uint8)  # the real files pickle a numpy array
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != len(d[b"labels"]):
                raise ValueError(f"{paths[n]}: data {data.shape} and {len(d[b'labels'])} labels; expected [N, 3072] and N")
            xs.append(torch.from_numpy(data.copy()).reshape(-1, 3, 32, 32))
            ys.append(torch.tensor(list(d[b"labels"]), dtype=torch.long))
        return torch.cat(xs), torch.cat(ys)

    train_x, train_y = read(CIFAR_FILES[:5])
    test_x, test_y = read(CIFAR_FILES[5:])
    return train_x, train_y, test_x, test_y


def load_digits(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits as (train_x float [N, 1, 8, 8] in 0..16, train_y, test_x, test_y): 80/20."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as e:
        raise SystemExit("error: --dataset digits needs scikit-learn: pip install 'dynamoe[examples]' "
                         "(or pip install scikit-learn)") from e
    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


# ------------------------------------------------------------------------------------ model
class ImageMoENet(nn.Module):
    """Tutel's example nets: conv layers, then an MoE layer whose experts output the 10 class logits.

    arch 'mnist': conv(C->32) conv(32->64) maxpool dropout; 'cifar': conv(C->32, pad 1) conv(32->32)
    maxpool dropout conv(32->64, pad 1) conv(64->64) maxpool dropout. On small images (the 8x8 digits)
    every conv is padded so the feature map does not vanish. ``use_moe=False``: fc1 -> relu -> fc2.
    """

    def __init__(self, arch: str, in_channels: int, size: int, num_experts: int = 4, top_k: int = 2,
                 hidden: int = 128, capacity_factor: float = 0.0, use_moe: bool = True, seed: int = 1):
        super().__init__()
        pad = 1 if size < 16 else 0
        torch.manual_seed(seed)
        if arch == "mnist":
            self.features = nn.Sequential(nn.Conv2d(in_channels, 32, 3, 1, padding=pad), nn.ReLU(),
                                          nn.Conv2d(32, 64, 3, 1, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Dropout(0.25), nn.Flatten())
        elif arch == "cifar":
            self.features = nn.Sequential(nn.Conv2d(in_channels, 32, 3, 1, padding=1), nn.ReLU(),
                                          nn.Conv2d(32, 32, 3, 1, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Dropout(0.25),
                                          nn.Conv2d(32, 64, 3, 1, padding=1), nn.ReLU(),
                                          nn.Conv2d(64, 64, 3, 1, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Dropout(0.25), nn.Flatten())
        else:
            raise ValueError(f"arch must be 'mnist' or 'cifar', got {arch!r}")
        with torch.no_grad():
            model_dim = self.features(torch.zeros(1, in_channels, size, size)).size(1)
        self.dropout = nn.Dropout(0.5)
        self.use_moe = use_moe
        if use_moe:
            self.moe = moe_layer(
                gate_type={"type": "top", "k": top_k, "capacity_factor": capacity_factor},
                experts={"type": "ffn", "num_experts_per_device": num_experts, "hidden_size_per_expert": hidden,
                         "output_dim": 10, "activation_fn": lambda x: self.dropout(F.relu(x))},
                model_dim=model_dim, seeds=(seed, seed + 1),
            )
        else:
            self.fc1, self.fc2 = nn.Linear(model_dim, hidden), nn.Linear(hidden, 10)
        self.l_aux: Tensor | None = None

    def forward(self, x_NCHW: Tensor, top_k: int | None = None) -> Tensor:
        h = self.features(x_NCHW)
        if self.use_moe:
            y = self.moe(h, top_k=top_k)
            self.l_aux = y.l_aux
        else:
            y = self.fc2(self.dropout(F.relu(self.fc1(h))))
        return F.log_softmax(y, dim=1)


# ------------------------------------------------------------------------------------ run
def build_parser(description: str, default_dataset: str) -> argparse.ArgumentParser:
    """Tutel's flags (--batch-size, --test-batch-size, --epochs, --lr, --gamma, --dry-run, --log-interval,
    --save-model, --no-moe) plus --data, --dataset, the MoE sizes, --seed and subset limits."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="folder with the dataset's files (see --help of the module)")
    p.add_argument("--dataset", choices=[default_dataset, "digits"], default=default_dataset,
                   help="'digits': scikit-learn's bundled 8x8 digits (no download)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 64 (Tutel's), 32 for digits")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=None, help="default: 14 (mnist), 20 (cifar10), 10 (digits)")
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate")
    p.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch")
    p.add_argument("--num-local-experts", type=int, default=4)
    p.add_argument("--top", type=int, default=2, help="experts per image (k)")
    p.add_argument("--hidden-size", type=int, default=128, help="expert hidden size")
    p.add_argument("--capacity-factor", type=float, default=0.0, help="0: dropless")
    p.add_argument("--l-aux-wt", type=float, default=0.01, help="weight of the balance loss")
    p.add_argument("--no-moe", action="store_true", help="a dense fc1 -> fc2 head instead of the MoE layer")
    p.add_argument("--dry-run", action="store_true", help="one batch per epoch, one epoch")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--save-model", default=None, metavar="FILE", help="save the state dict here at the end")
    p.add_argument("--limit-train", type=int, default=None, help="use only the first N training images")
    p.add_argument("--limit-test", type=int, default=None, help="use only the first N test images")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    return p


def _prepare(args, arch: str):
    if args.dataset == "digits":
        tx, ty, vx, vy = load_digits(args.seed)
    else:
        if args.data is None:
            raise SystemExit("error: no --data folder given. " + (MNIST_HELP if arch == "mnist" else CIFAR_HELP))
        try:
            tx, ty, vx, vy = (load_mnist if arch == "mnist" else load_cifar10)(args.data)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
    if args.limit_train:
        tx, ty = tx[:args.limit_train], ty[:args.limit_train]
    if args.limit_test:
        vx, vy = vx[:args.limit_test], vy[:args.limit_test]
    # normalise with the training set's per-channel statistics
    tx, vx = tx.float(), vx.float()
    mean = tx.mean(dim=(0, 2, 3), keepdim=True)
    std = tx.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (tx - mean) / std, ty, (vx - mean) / std, vy


def _check(p: argparse.ArgumentParser, args) -> None:
    if args.batch_size is None:
        args.batch_size = 32 if args.dataset == "digits" else 64
    for name in ("batch_size", "test_batch_size", "num_local_experts", "top", "hidden_size", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.epochs is not None and args.epochs < 1:
        p.error(f"argument --epochs: must be >= 1, got {args.epochs}")
    if args.top > args.num_local_experts:
        p.error(f"argument --top: must be <= --num-local-experts ({args.num_local_experts}), got {args.top}")


@torch.no_grad()
def evaluate(model: ImageMoENet, x: Tensor, y: Tensor, batch_size: int, top_k: int | None = None) -> tuple[float, float]:
    """(mean nll, accuracy) on (x, y)."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        out = model(x[i:i + batch_size], top_k=top_k)
        loss += float(F.nll_loss(out, y[i:i + batch_size], reduction="sum"))
        correct += int((out.argmax(1) == y[i:i + batch_size]).sum())
    return loss / max(len(y), 1), correct / max(len(y), 1)


def run(arch: str, description: str, argv=None) -> dict:
    """Parse the flags, train, test after every epoch; returns {'test_accuracy': [...], 'test_loss': [...],
    'train_loss': [...], 'seconds': float}."""
    default_dataset = "mnist" if arch == "mnist" else "cifar10"
    p = build_parser(description, default_dataset)
    args = p.parse_args(argv)
    _check(p, args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tx, ty, vx, vy = _prepare(args, arch)
    epochs = args.epochs or (10 if args.dataset == "digits" else 14 if arch == "mnist" else 20)
    if args.dry_run:
        epochs = 1
    model = ImageMoENet(arch, tx.size(1), tx.size(2), args.num_local_experts, args.top, args.hidden_size,
                        args.capacity_factor, not args.no_moe, args.seed).to(device)
    tx, ty, vx, vy = tx.to(device), ty.to(device), vx.to(device), vy.to(device)
    print(f"[data] {args.dataset}: {len(ty)} training and {len(vy)} test images of {tuple(tx.shape[1:])}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {arch} net, {'MoE: %d experts, top-%d' % (args.num_local_experts, args.top) if not args.no_moe else 'dense'}, "
          f"{n_params} parameters")
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    g = torch.Generator().manual_seed(args.seed)
    history = {"test_accuracy": [], "test_loss": [], "train_loss": []}
    t0 = time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(ty), generator=g).to(device)
        batches = range(0, len(ty), args.batch_size)
        for b, i in enumerate(batches):
            idx = perm[i:i + args.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(tx[idx]), ty[idx])
            total = loss + args.l_aux_wt * model.l_aux if (model.use_moe and args.l_aux_wt) else loss
            total.backward()
            optimizer.step()
            if b % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{i}/{len(ty)} ({100.0 * i / len(ty):.0f}%)]\tLoss: {loss.item():.6f}")
            if args.dry_run:
                break
        history["train_loss"].append(loss.item())
        test_loss, acc = evaluate(model, vx, vy, args.test_batch_size)
        history["test_loss"].append(test_loss)
        history["test_accuracy"].append(acc)
        extra = ""
        if not args.no_moe and args.num_local_experts > 1:  # the same weights at other k: a free switch
            ks = sorted({1, args.top, args.num_local_experts})
            extra = ", ".join(f"top-{k} {evaluate(model, vx, vy, args.test_batch_size, k)[1]:.2%}" for k in ks)
            extra = f" ({extra})"
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {round(acc * len(vy))}/{len(vy)} ({acc:.2%}){extra}\n")
        scheduler.step()
    history["seconds"] = time.perf_counter() - t0
    print(f"[done] {epochs} epochs in {history['seconds']:.1f}s; best test accuracy {max(history['test_accuracy']):.2%}")
    if args.save_model:
        torch.save(model.state_dict(), args.save_model)
    sys.stdout.flush()
    return history
