"""A plain MoE reference, written differently from dynamoe on purpose: Python loops over tokens and
choices, per-token vector math, and explicit slot counters for the capacity rule."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ref_capacity(T: int, E: int, k: int, cf: float, loads: list[int]) -> int:
    per_expert = math.ceil(T / E)
    if cf > 0:
        return k * int(cf * per_expert)
    if cf == 0:
        return max(loads)
    return min(max(loads), k * int(-cf * per_expert))


def ref_softmax_choice(logits_t: torch.Tensor, k: int, renorm: bool):
    probs = torch.softmax(logits_t.double(), dim=0)
    order = sorted(range(len(probs)), key=lambda e: -float(probs[e].detach()))[:k]
    w = [probs[e] for e in order]
    if renorm:
        s = sum(w)
        w = [v / s for v in w]
    return order, w, float(probs.max().detach())


def ref_softmax_group_choice(logits_t, k, n_group, topk_group, renorm, scale, group_rank):
    """One token's group-limited softmax routing: groups ranked by their best probability ('max') or the
    sum of their two best ('top2_sum'), the best topk_group kept, the k most probable experts inside."""
    probs = [float(p) for p in torch.softmax(logits_t.double(), dim=0)]
    size = len(probs) // n_group
    allowed = list(range(len(probs)))
    if topk_group < n_group:
        def rank(g):
            vals = sorted(probs[g * size:(g + 1) * size], reverse=True)
            return vals[0] if group_rank == "max" else sum(vals[:2])
        groups = sorted(range(n_group), key=lambda g: -rank(g))[:topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    order = sorted(allowed, key=lambda e: -probs[e])[:k]
    w = [probs[e] for e in order]
    if renorm:
        w = [v / sum(w) for v in w]
    return order, [v * scale for v in w]


def ref_sigmoid_choice(logits_t, k, bias, n_group, topk_group, renorm, scale):
    s = torch.sigmoid(logits_t.double())
    b = s + (bias.double() if bias is not None else 0)
    E = len(s)
    size = E // n_group
    allowed = list(range(E))
    if n_group > 1 and topk_group < n_group:
        gscore = []
        for g in range(n_group):
            vals = sorted((float(b[e].detach()) for e in range(g * size, (g + 1) * size)), reverse=True)
            gscore.append(vals[0] + vals[1] if bias is not None and size >= 2 else vals[0])
        groups = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    order = sorted(allowed, key=lambda e: -float(b[e].detach()))[:k]
    w = [s[e] for e in order]
    if renorm:
        tot = sum(w)
        w = [v / tot for v in w]
    return order, [v * scale for v in w], float(s.max().detach())


def ref_expert(layer, e: int, v: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    if hasattr(ex, "batched_fc1_w"):
        h = ex.batched_fc1_w[e] @ v
        if ex.batched_fc1_bias is not None:
            h = h + ex.batched_fc1_bias[e]
        h = ex.activation_fn(h)
        out = h @ ex.batched_fc2_w[e]
        return out + ex.batched_fc2_bias[e] if ex.batched_fc2_bias is not None else out
    gu = ex.gate_up_proj[e] @ v
    if ex.gate_up_proj_bias is not None:
        gu = gu + ex.gate_up_proj_bias[e]
    g, u = gu[: ex.hidden_size], gu[ex.hidden_size:]
    if ex.activation == "silu":
        h = g * torch.sigmoid(g) * u
    elif ex.activation == "gelu":
        h = F.gelu(g) * u
    elif ex.activation == "relu":
        h = torch.clamp(g, min=0) * u
    elif ex.activation == "gpt_oss":
        g = torch.minimum(g, torch.full_like(g, ex.limit))
        u = torch.maximum(torch.minimum(u, torch.full_like(u, ex.limit)), torch.full_like(u, -ex.limit))
        h = (u + 1) * g * torch.sigmoid(ex.alpha * g)
    else:
        raise NotImplementedError(ex.activation)
    out = ex.down_proj[e] @ h
    return out + ex.down_proj_bias[e] if ex.down_proj_bias is not None else out


def reference_moe(layer, x: torch.Tensor, k: int | None = None, cf: float | None = None):
    """Returns (y with x's shape [..., O], dropped count, loads per expert)."""
    cfg, gcfg = layer.config, layer.config.gates[0]
    k = gcfg.k if k is None else k
    cf = gcfg.capacity_factor if cf is None else cf
    D = layer.model_dim
    X = x.reshape(-1, D).to(next(layer.experts.parameters()).dtype)
    T, E = X.shape[0], layer.num_global_experts
    gate = layer.gates[0]
    choices, weights, prio = [], [], []
    for t in range(T):
        if gcfg.type == "cosine_top":
            logits_t = gate(X[t : t + 1])[0]
        else:
            logits_t = (gate.wg.weight.double() @ X[t].double()) if gcfg.fp32_gate or X.dtype == torch.float64 else gate.wg.weight @ X[t]
        if gcfg.type == "sigmoid":
            renorm = True if gcfg.normalize is None else gcfg.normalize
            o, w, p = ref_sigmoid_choice(logits_t, k, getattr(gate, "e_score_correction_bias", None),
                                         gcfg.n_group, gcfg.topk_group, renorm, gcfg.route_scale)
        else:
            renorm = (cfg.normalize_gate and k > 1) if gcfg.normalize is None else gcfg.normalize
            o, w, p = ref_softmax_choice(logits_t, k, renorm)
        choices.append(o)
        weights.append(w)
        prio.append(p)
    loads = [0] * E
    for o in choices:
        for e in o:
            loads[e] += 1
    C = ref_capacity(T, E, k, cf, loads)
    token_order = list(range(T))
    if cfg.batch_prioritized_routing:
        token_order = sorted(token_order, key=lambda t: -prio[t])
    used = [0] * E
    keep = set()
    for j in range(k):
        for t in token_order:
            e = choices[t][j]
            if used[e] < C:
                keep.add((t, j))
            used[e] += 1
    rows = []
    for t in range(T):
        acc = 0
        for j in range(k):
            if (t, j) in keep:
                e = choices[t][j]
                w = weights[t][j].to(X.dtype)
                if cfg.is_postscore:
                    acc = acc + w * ref_expert(layer, e, X[t])
                else:
                    acc = acc + ref_expert(layer, e, w * X[t])
        if isinstance(acc, int):
            acc = X.new_zeros(layer._out_dim())
        if layer.shared_experts is not None:
            acc = acc + layer.shared_experts(X[t : t + 1])[0]
        rows.append(acc)
    y = torch.stack(rows) if rows else X.new_zeros(0, layer._out_dim())
    out_shape = list(x.shape[:-1]) + [layer._out_dim()]
    return y.reshape(out_shape).to(x.dtype), T * k - len(keep), loads
