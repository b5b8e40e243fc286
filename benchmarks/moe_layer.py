"""MoE layer timing against an HF-style per-expert loop and the FLOP / weight-read floors.

Every number is measured in the same run, interleaved over rounds (method order rotates each
round), and reported as a median. All methods use the same weights and FFN experts (fc1 -> ReLU ->
fc2, no biases), so the floor is exactly "one dense matmul pair over T*k rows" in the same dtype (with the
backward: its four products), into buffers allocated once
(oneDNN: AMX tiles where the CPU has AMX-BF16, AVX512-BF16 dot products where it has those).

    python benchmarks/moe_layer.py                      # A, C, D1, D8 x fp32/bf16 x fwd/fwd+bwd x cf 0/1
    python benchmarks/moe_layer.py --configs A D1 --dtypes float32 --rounds 5 --capacity-factors 0
    python benchmarks/moe_layer.py --decode-train --threads 1 2   # D1/D8 forward+backward vs module loops

Columns: ours / hf-loop / floor are median milliseconds; ratios are ours divided by the floor and
hf-loop divided by ours. ``cf`` is our layer's capacity factor (0 dropless; 1.0 drops overflow, so
it may do less work than the dropless loop and floor). For decode configs (D1, D8) "read ms" is
the cold weight-read floor: bytes of the distinct active experts' weights / measured read bandwidth.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer  # noqa: E402

CONFIGS = {  # name: (T, D, F, E, k)
    "A": (4096, 1024, 1024, 8, 2),
    "C": (2048, 512, 512, 64, 8),
    "D1": (1, 1024, 512, 64, 8),
    "D8": (8, 1024, 512, 64, 8),
}
DECODE = {"D1", "D8"}


def hf_loop(x, gate_w, w1_EFD, w2_EFD, k):
    """transformers-style sparse MoE block: one-hot mask, loop over hit experts, index_add."""
    logits = F.linear(x, gate_w)
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w1_EFD.size(0)).permute(2, 1, 0)  # [E, k, T]
    for e in torch.nonzero(mask.sum(dim=(-1, -2)) > 0)[:, 0].tolist():
        choice, tok = torch.where(mask[e])
        h = F.relu(x[tok] @ w1_EFD[e].t()) @ w2_EFD[e]
        out.index_add_(0, tok, h * w[tok, choice, None])
    return out


def hf_loop_modules(x, gate_w, experts, k):
    """The same block over per-expert nn.Linear modules (transformers' ModuleList experts): experts
    not hit get no gradient at all, so this is the per-expert loop a decode backward must match."""
    logits = F.linear(x, gate_w)
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=len(experts)).permute(2, 1, 0)  # [E, k, T]
    for e in torch.nonzero(mask.sum(dim=(-1, -2)) > 0)[:, 0].tolist():
        choice, tok = torch.where(mask[e])
        fc1, fc2 = experts[e]
        out.index_add_(0, tok, fc2(F.relu(fc1(x[tok]))) * w[tok, choice, None])
    return out


def _dropless_layer(name, dtype, capacity_factor=0.0):
    """Config ``name``'s FFN layer (seed 0; dropless unless told) with its gate and stacked expert weights."""
    T, D, Fh, E, k = CONFIGS[name]
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, gates=[GateConfig(k=k, capacity_factor=capacity_factor)],
                               experts=ExpertConfig(num_experts_per_device=E, hidden_size_per_expert=Fh,
                                                    has_fc1_bias=False, has_fc2_bias=False), aux_loss="none")).to(dtype)
    return layer, layer.gates[0].wg.weight, layer.experts.batched_fc1_w, layer.experts.batched_fc2_w


def run_decode_train(name, dtype, rounds, warmup):
    """Forward+backward at decode size: ours, the per-expert loop over the stacked [E, F, D] weights
    and over per-expert modules. Median ms over interleaved rounds, fresh tokens each round."""
    T, D, Fh, E, k = CONFIGS[name]
    layer, gate_w, w1, w2 = _dropless_layer(name, dtype)
    mods = torch.nn.ModuleList()
    for e in range(E):
        fc1 = torch.nn.Linear(D, Fh, bias=False, dtype=dtype)
        fc2 = torch.nn.Linear(Fh, D, bias=False, dtype=dtype)
        with torch.no_grad():
            fc1.weight.copy_(w1[e])
            fc2.weight.copy_(w2[e].t())
        mods.append(torch.nn.ModuleList([fc1, fc2]))
    params = list(layer.parameters()) + list(mods.parameters())

    def step(fn):
        def run(x):
            x = x.detach().requires_grad_()
            y = fn(x)
            y.backward(torch.ones_like(y))
        return run

    methods = {"ours": step(layer), "hf-stacked": step(lambda x: hf_loop(x, gate_w, w1, w2, k)),
               "hf-modules": step(lambda x: hf_loop_modules(x, gate_w, mods, k))}
    xs = [torch.randn(T, D, dtype=dtype) for _ in range(rounds + 1)]
    for _ in range(warmup):
        for fn in methods.values():
            fn(xs[-1])
    names, res = list(methods), {m: [] for m in methods}
    for r in range(rounds):
        for i in range(len(names)):
            m = names[(r + i) % len(names)]
            for p_ in params:
                p_.grad = None
            res[m].append(timed(lambda: methods[m](xs[r])) * 1e3)
    return {m: statistics.median(v) for m, v in res.items()}


def read_bandwidth_gbs(dtype) -> float:
    """Memory read bandwidth (GB/s) from summing a buffer much larger than the caches."""
    buf = torch.ones(256 * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / statistics.median(times) / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_config(name, dtype, rounds, backward, bw_gbs, warmup, capacity_factor=0.0):
    T, D, Fh, E, k = CONFIGS[name]
    layer, gate_w, w1, w2 = _dropless_layer(name, dtype, capacity_factor)
    decode = name in DECODE
    # decode draws fresh tokens (and so fresh experts) each round; otherwise one batch
    xs = [torch.randn(T, D, dtype=dtype) for _ in range(rounds + 1)]
    x_rows = torch.randn(T * k, D, dtype=dtype)
    w1_DF = torch.randn(D, Fh, dtype=dtype) / D ** 0.5
    w2_FD = torch.randn(Fh, D, dtype=dtype) / Fh ** 0.5

    def ours(x):
        if backward:
            x = x.detach().requires_grad_()
            y = layer(x)
            y.backward(torch.ones_like(y))
        else:
            with torch.no_grad():
                layer(x)

    def hf(x):
        if backward:
            x = x.detach().requires_grad_()
            y = hf_loop(x, gate_w, w1, w2, k)
            y.backward(torch.ones_like(y))
        else:
            with torch.no_grad():
                hf_loop(x, gate_w, w1, w2, k)

    # the floor's products write into buffers allocated once: fresh 16-32 MB outputs cost page faults that vary
    # run to run (up to 2x the matmuls' own time on the SPR VM), which are not the matmuls' floor
    N = T * k
    buf = {"h": (N, Fh), "y": (N, D), "dh": (N, Fh), "dx": (N, D), "dw1": (D, Fh), "dw2": (Fh, D)}
    buf = {n: torch.empty(*shape, dtype=dtype) for n, shape in buf.items()}
    g_rows = torch.ones(N, D, dtype=dtype)

    def floor(_x):
        with torch.no_grad():
            h = torch.mm(x_rows, w1_DF, out=buf["h"])
            torch.mm(h, w2_FD, out=buf["y"])
            if backward:   # the pair's backward: dh, dW2, dx, dW1
                dh = torch.mm(g_rows, w2_FD.t(), out=buf["dh"])
                torch.mm(h.t(), g_rows, out=buf["dw2"])
                torch.mm(dh, w1_DF.t(), out=buf["dx"])
                torch.mm(x_rows.t(), dh, out=buf["dw1"])

    methods = {"ours": ours, "hf": hf, "floor": floor}
    for _ in range(warmup):  # oneDNN builds kernels per shape on first use: keep that out of the timing
        for fn in methods.values():
            fn(xs[-1])
    res = {m: [] for m in methods}
    floors_ms = []
    names = list(methods)
    for r in range(rounds):
        x = xs[r]
        for i in range(len(names)):
            m = names[(r + i) % len(names)]
            if m in ("ours", "hf") and backward:
                layer.zero_grad(set_to_none=True)
            res[m].append(timed(lambda: methods[m](x)) * 1e3)
        if decode and not backward:
            with torch.no_grad():
                ids = torch.topk(F.linear(x, gate_w).float(), k).indices
            active = int(torch.unique(ids).numel())
            nbytes = active * (w1[0].numel() + w2[0].numel()) * w1.element_size()
            floors_ms.append(nbytes / (bw_gbs * 1e9) * 1e3)
    med = {m: statistics.median(v) for m, v in res.items()}
    read_floor = statistics.median(floors_ms) if floors_ms else None
    return med["ours"], med["hf"], med["floor"], read_floor


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of every method before timing")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--capacity-factors", type=float, nargs="+", default=[0.0, 1.0],
                   help="our layer's capacity factors (0 = dropless)")
    p.add_argument("--decode-train", action="store_true",
                   help="D1/D8 forward+backward against per-expert loops (stacked weights and per-expert modules)")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="torch threads (--decode-train: each in turn)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.decode_train:
        print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
              f"forward+backward, median ms of {args.rounds} interleaved rounds")
        print(f"{'config':7} {'dtype':9} {'threads':>7} {'ours':>8} {'hf-stacked':>10} {'hf-modules':>10} {'modules/ours':>12}")
        for th in args.threads or [torch.get_num_threads()]:
            torch.set_num_threads(th)
            for name in [c for c in args.configs if c in DECODE] or sorted(DECODE):
                for dt in args.dtypes:
                    r = run_decode_train(name, getattr(torch, dt), args.rounds, args.warmup)
                    print(f"{name:7} {dt:9} {th:7d} {r['ours']:8.2f} {r['hf-stacked']:10.2f} {r['hf-modules']:10.2f} "
                          f"{r['hf-modules'] / r['ours']:12.2f}", flush=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads[0])
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, AMX-BF16 {'yes' if has_amx() else 'no'}")
    bw = {}
    for dt in args.dtypes:
        bw[dt] = read_bandwidth_gbs(getattr(torch, dt))
        print(f"# read bandwidth ({dt}): {bw[dt]:.1f} GB/s")
    print(f"{'config':7} {'dtype':9} {'pass':8} {'cf':>4} {'ours ms':>9} {'hf-loop ms':>10} {'floor ms':>9} "
          f"{'ours/floor':>10} {'hf/ours':>8} {'read ms':>8}")
    passes = ["fwd"] + ([] if args.no_backward else ["fwd+bwd"])
    for name in args.configs:
        for dt in args.dtypes:
            for ps in passes:
                for cf in args.capacity_factors:
                    ours, hf, floor, read = run_config(name, getattr(torch, dt), args.rounds, ps == "fwd+bwd", bw[dt],
                                                       args.warmup, cf)
                    read_s = f"{read:8.2f}" if read is not None else f"{'-':>8}"
                    print(f"{name:7} {dt:9} {ps:8} {cf:4.1f} {ours:9.2f} {hf:10.2f} {floor:9.2f} {ours / floor:10.2f} "
                          f"{hf / ours:8.2f} {read_s}", flush=True)


if __name__ == "__main__":
    main()
