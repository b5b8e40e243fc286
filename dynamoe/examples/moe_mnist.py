"""Tutel's moe_mnist on dynamoe: a small conv net whose classifier is an MoE layer (experts output the
10 logits), trained with Adadelta.

Usage: python -m dynamoe.examples.moe_mnist --data DIR            # MNIST idx files (optionally .gz)
       python -m dynamoe.examples.moe_mnist --dataset digits      # scikit-learn's bundled 8x8 digits

``--data`` is a folder with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
t10k-labels-idx1-ubyte (each optionally .gz; torchvision's MNIST/raw folder works too). Without it the
example says where to get them. ``--dataset digits`` needs no download and reaches > 90% test accuracy
in a few seconds. After each epoch the test accuracy is also shown at other top-k values: the same
weights, switched at run time. Tutel's flags: --batch-size, --test-batch-size, --epochs, --lr, --gamma,
--dry-run, --log-interval, --save-model, --no-moe.
"""
from __future__ import annotations

from ._vision import run


def main(argv=None) -> dict:
    return run("mnist", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
