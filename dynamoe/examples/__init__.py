"""Runnable examples mirroring Tutel's, with Tutel's command-line flags, seeds and data (CPU or CUDA):
``helloworld`` prints the per-step losses Tutel's helloworld prints for the same flags.

Run any of them as a module, e.g. ``python -m dynamoe.examples.helloworld --help``:

* ``helloworld`` -- Tutel's helloworld: ``moe_layer`` trained with SGD, per-call switches from the flags.
* ``helloworld_switch`` -- one layer, a different (top_k, capacity_factor, layout) every step; the
  parameters never move.
* ``helloworld_amp`` -- the same loop under ``torch.autocast`` with fp32 master weights.
* ``helloworld_custom_gate_expert`` -- user gate and expert classes plugged into ``moe_layer``.
* ``helloworld_from_scratch`` -- an MoE layer assembled from ``dynamoe.ops`` and the dispatch plan,
  documenting the data flow.
* ``helloworld_ddp`` -- helloworld's model in ``dynamoe.parallel.data_parallel`` (DDP that leaves the
  expert parameters alone); on one process it makes its own 1-rank gloo group.
* ``helloworld_ddp_tutel`` -- helloworld trained with Tutel's ``TutelDistributedOptimizer`` (SGD), or
  ``--optimizer zero_adamw``: the ZeRO-1 ``ZeroOptimizer`` (AdamW, fp32 masters).
* ``bandwidth_test`` -- all-to-all bandwidth table, ``dynamoe.net`` vs raw ``torch.distributed`` (>= 2 ranks);
  ``--loop N`` prints Tutel's all-to-all / all-reduce / all-gather / reduce-scatter lines instead.
* ``nccl_all_to_all_v`` / ``nccl_all_gather_v`` -- ``net.batch_all_to_all_v`` with uneven and zero counts and
  ``net.batch_all_gather_v`` with a different row count per rank, checked against what each rank
  expects (any backend, despite Tutel's names).
* ``moe_mnist`` / ``moe_cifar10`` -- Tutel's image classifiers (conv layers, then an MoE layer whose experts
  output the logits) on MNIST idx files / CIFAR-10 python batches (``--data DIR``), or on scikit-learn's
  bundled 8x8 digits (``--dataset digits``: no download, > 90% test accuracy in seconds).

The embedded demo model (``dynamoe/assets/demo-moe``, what ``make serve`` serves) is built by:

* ``demo_data`` -- the deterministic synthetic chat corpus (arithmetic, lists, words, units, Python code),
  with a held-out split; ``demo_tokenizer`` -- its byte-level BPE and ChatML chat template.
* ``train_demo`` -- trains the Qwen3-MoE demo model on dynamoe's MoE layers (balance loss, AdamW, resumable
  atomic checkpoints) and exports the HF folder with its model card.
* ``eval_demo`` -- held-out exact-match scores per skill (code run against tests); ``expert_usage`` --
  a PNG heatmap of routing share per skill and expert, for each layer.
* ``oai_request_stream`` -- a streaming chat client for ``dynamoe serve`` (or any OpenAI-compatible
  server): ``--url 127.0.0.1:8000 --prompt ...``; uses ``openai`` when installed, else ``httpx``.

Under ``torchrun --nproc_per_node=N -m dynamoe.examples.<name> ...`` the examples join the process
group (gloo on CPU, NCCL on CUDA) and spread the experts over the ranks; ``helloworld_switch`` then
also checks that every (adaptive_r, a2a_ffn_overlap_degree, use_2dh) setting gives the same loss.

Each module exposes ``main(argv=None)`` (the training examples return the per-step losses); ``_common``
holds the shared flags, validation and training loop.
"""
