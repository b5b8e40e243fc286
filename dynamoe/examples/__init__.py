"""Runnable examples mirroring Tutel's, with Tutel's command-line flags (CPU or CUDA).

Run any of them as a module, e.g. ``python -m dynamoe.examples.helloworld --help``:

* ``helloworld`` -- Tutel's helloworld: ``moe_layer`` trained with SGD, per-call switches from the flags.
* ``helloworld_switch`` -- one layer, a different (top_k, capacity_factor, layout) every step; the
  parameters never move.
* ``helloworld_amp`` -- the same loop under ``torch.autocast`` with fp32 master weights.
* ``helloworld_custom_gate_expert`` -- user gate and expert classes plugged into ``moe_layer``.
* ``helloworld_from_scratch`` -- an MoE layer assembled from ``dynamoe.ops`` and the dispatch plan,
  documenting the data flow.

Each module exposes ``main(argv=None)`` (returns the per-step losses); ``_common`` holds the shared
flags, validation and training loop.
"""
