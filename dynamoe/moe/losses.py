"""Load-balancing losses and the auxiliary-loss-free bias update.

Legend: T tokens, E experts, K experts per token. ``scores_TE`` are the gate's probabilities
(softmax) or affinities (sigmoid); ``ids_TK`` the chosen experts. All losses are computed in fp32
and are 1.0 (gshard, deepseek expert-level) or K (switch) for a perfectly balanced router.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "gshard_loss",
    "switch_loss",
    "load_importance_loss",
    "deepseek_expert_loss",
    "deepseek_device_loss",
    "router_z_loss",
    "update_selection_bias",
]


def _counts_E(ids: Tensor, num_experts: int, dtype=torch.float32) -> Tensor:
    return torch.bincount(ids.reshape(-1), minlength=num_experts).to(dtype)


def gshard_loss(scores_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """GShard / Tutel: E * sum_e mean_t(p_te) * (share of tokens whose *first* choice is e)."""
    T, E = scores_TE.shape
    if T == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    me_E = scores_TE.float().mean(0)
    ce_E = _counts_E(ids_TK[:, 0], E) / T
    return E * torch.sum(me_E * ce_E)


def switch_loss(scores_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """Switch Transformer, extended to K choices as in transformers' Mixtral/Qwen-MoE:
    E * sum_e mean_t(p_te) * (assignments to e / T). Equals K when balanced."""
    T, E = scores_TE.shape
    if T == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    return E * torch.sum(scores_TE.float().mean(0) * _counts_E(ids_TK, E) / T)


def load_importance_loss(probs_TE: Tensor, noisy_logits_TE: Tensor, ids_TK: Tensor, gate_noise: float) -> Tensor:
    """Tutel's ``is_gshard_loss=False`` loss (Shazeer et al. 2017), with Tutel's inputs:
    ``probs_TE`` = softmax of the noise-free logits, ``noisy_logits_TE`` = the logits routing chose
    from. Mean of the squared coefficients of variation of importance (summed probabilities) and
    of a smooth load estimate: P(N(0, noise/E) < p_te - noisy logit of the token's k-th choice)."""
    if gate_noise <= 0:
        raise ValueError(f"load_importance_loss needs gate_noise > 0 (it normalises by the noise), got {gate_noise}")
    E = probs_TE.size(1)
    probs = probs_TE.float()

    def cv2(v: Tensor) -> Tensor:
        return v.var() / (v.mean() ** 2 + 1e-10)

    threshold_T1 = noisy_logits_TE.float().gather(1, ids_TK[:, -1:])
    load_E = torch.special.ndtr((probs - threshold_T1) / (gate_noise / E)).sum(0)
    return (cv2(probs.sum(0)) + cv2(load_E)) / 2.0


def deepseek_expert_loss(scores_TE: Tensor, ids_TK: Tensor) -> Tensor:
    """DeepSeek expert-level balance loss: sum_e f_e * P_e with f_e = E/(K T) * count_e and P_e the
    mean normalised affinity (scores divided by their per-token sum)."""
    T, E = scores_TE.shape
    K = ids_TK.size(1)
    if T == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    s = scores_TE.float()
    P_E = (s / s.sum(-1, keepdim=True).clamp_min(1e-20)).mean(0)
    f_E = _counts_E(ids_TK, E) * (E / (K * T))
    return torch.sum(f_E * P_E)


def deepseek_device_loss(scores_TE: Tensor, ids_TK: Tensor, num_devices: int) -> Tensor:
    """DeepSeek device-level balance loss over ``num_devices`` equal groups of consecutive experts:
    sum_d mean_{e in d}(f_e) * sum_{e in d}(P_e)."""
    T, E = scores_TE.shape
    if num_devices < 1 or E % num_devices:
        raise ValueError(f"num_devices must be >= 1 and divide the expert count {E}, got {num_devices}")
    K = ids_TK.size(1)
    if T == 0:
        return scores_TE.new_zeros((), dtype=torch.float32)
    s = scores_TE.float()
    P_DE = (s / s.sum(-1, keepdim=True).clamp_min(1e-20)).mean(0).view(num_devices, -1)
    f_DE = (_counts_E(ids_TK, E) * (E / (K * T))).view(num_devices, -1)
    return torch.sum(f_DE.mean(1) * P_DE.sum(1))


def router_z_loss(logits_TE: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean_t logsumexp(logits_t)^2 (keeps logits small)."""
    if logits_TE.size(0) == 0:
        return logits_TE.new_zeros((), dtype=torch.float32)
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


@torch.no_grad()
def update_selection_bias(bias_E: Tensor, load_E: Tensor, rate: float) -> Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts
    and lower it for over-loaded ones by ``rate``: bias += rate * sign(mean(load) - load). In place."""
    load = load_E.float()
    bias_E.add_(rate * torch.sign(load.mean() - load).to(bias_E.dtype))
    return bias_E
