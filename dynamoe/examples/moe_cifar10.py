"""Tutel's moe_cifar10 on dynamoe: a four-conv net whose classifier is an MoE layer (experts output the
10 logits), trained with Adadelta.

Usage: python -m dynamoe.examples.moe_cifar10 --data DIR          # CIFAR-10 python batches
       python -m dynamoe.examples.moe_cifar10 --dataset digits    # scikit-learn's bundled 8x8 digits

``--data`` is the folder cifar-10-batches-py (or its parent) of cifar-10-python.tar.gz: data_batch_1 ..
data_batch_5 and test_batch. Without it the example says where to get them. ``--dataset digits`` needs
no download. After each epoch the test accuracy is also shown at top-1 and top-E: the same weights,
switched at run time (Tutel's example evaluates top-1, 2 and 8 the same way).
"""
from __future__ import annotations

from ._vision import run


def main(argv=None) -> dict:
    return run("cifar", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
