"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, GLM-5.3): the residual stream widened to N streams
[B, T, N, D]. Around each sublayer a projection of the RMS-normalised streams gives pre (sigmoid: collapses the
streams into the sublayer's input), post (2 sigmoid: spreads its output over the streams) and comb (softmax rows,
then Sinkhorn-normalised towards a doubly stochastic matrix: mixes the streams), all in fp32:

    h <- post * f(norm(sum_n pre_n h_n)) + comb^T h

The independent variant (Hy4, :class:`IndependentHyperConnection`) has no comb: h <- h + post * f(norm(sum_n pre_n
h_n)), post = ``hc_magnitude`` sigmoid(.) + eps.

The gated variant (Qwen4-Exp, :class:`GatedStreamMixer`) normalises each stream (:class:`StreamRMSNorm`), collapses
them by the mean of per-channel sigmoid gates from a low-rank projection, and spreads the output with per-stream
weights: h <- h + inject * f(mean_n(gate_n * norm(h)_n)), inject = 2 sigmoid(.); its last mixer (no inject) is the
model's final collapse.

Legend: B batch rows, T tokens, N streams (``hc_mult``), D model dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .norms import RMSNorm

__all__ = ["HyperConnection", "HyperDecoderLayer", "IndependentHyperConnection", "IndependentHyperDecoderLayer",
           "HyperHeadNorm", "StreamEmbedding", "rms_unweighted", "StreamRMSNorm", "GatedStreamMixer"]


def rms_unweighted(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last dim, no weight (statistics in fp32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """Pre / post / comb weights of N residual streams around one sublayer (``fn`` [(2 + N) N, N D], ``base``,
    ``scale`` [3], fp32). ``forward(h [B, T, N, D]) -> (post [B, T, N], comb [B, T, N, N], collapsed [B, T, D])``."""

    def __init__(self, hidden_size: int, streams: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        N = streams
        self.streams, self.iters, self.hc_eps, self.norm_eps = N, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + N) * N, N * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + N) * N, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, h_BTND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, N, _ = h_BTND.shape
        mixed = F.linear(rms_unweighted(h_BTND.reshape(B, T, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixed.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(B, T, N, N) * s_comb + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = _sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * h_BTND).sum(dim=2).to(h_BTND.dtype)
        return post, comb, collapsed


def _hyper_residual(h_BTND: Tensor, post: Tensor, comb: Tensor, out_BTD: Tensor) -> Tensor:
    """post * the sublayer's output on each stream + comb^T mixing the input streams."""
    dt = h_BTND.dtype
    return post.to(dt).unsqueeze(-1) * out_BTD.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h_BTND)


class HyperDecoderLayer(nn.Module):
    """A token mixer and an MLP, each between the norm of its collapsed streams and a hyper-connection residual
    (names as transformers': ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``, ``attn_hc``,
    ``ffn_hc``)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, attn_hc: HyperConnection, ffn_hc: HyperConnection):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc

    def forward(self, h_BTND: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        post, comb, x = self.attn_hc(h_BTND)
        h_BTND = _hyper_residual(h_BTND, post, comb,
                                 self.self_attn(self.input_layernorm(x), positions_BT, cache, slots, kv_len))
        post, comb, x = self.ffn_hc(h_BTND)
        return _hyper_residual(h_BTND, post, comb, self.mlp(self.post_attention_layernorm(x)))


class StreamEmbedding(nn.Embedding):
    """nn.Embedding whose output is copied onto ``streams`` residual streams [B, T, N, D] (same parameter, name)."""

    streams = 1

    def forward(self, ids: Tensor) -> Tensor:
        h = super().forward(ids)
        return h.unsqueeze(2).expand(*h.shape[:2], self.streams, h.size(-1)).contiguous()


class IndependentHyperConnection(nn.Module):
    """Pre / post weights of N residual streams around one sublayer, no mixing (``fn`` [2 N, N D], ``base`` [2 N],
    ``scale`` [2], fp32; Hy4). ``forward(h [B, T, N, D]) -> (post [B, T, N], collapsed [B, T, D])``."""

    def __init__(self, hidden_size: int, streams: int, magnitude: float, hc_eps: float, norm_eps: float):
        super().__init__()
        N = streams
        self.streams, self.magnitude, self.hc_eps, self.norm_eps = N, magnitude, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(2 * N, N * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(2 * N, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.float32))

    def forward(self, h_BTND: Tensor) -> tuple[Tensor, Tensor]:
        N = self.streams
        mixed = F.linear(rms_unweighted(h_BTND.flatten(2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w = mixed.split(N, dim=-1)
        pre_b, post_b = self.base.split(N)
        s_pre, s_post = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = self.magnitude * torch.sigmoid(post_w * s_post + post_b) + self.hc_eps
        return post, (pre.unsqueeze(-1) * h_BTND).sum(dim=2).to(h_BTND.dtype)


class IndependentHyperDecoderLayer(HyperDecoderLayer):
    """:class:`HyperDecoderLayer` around :class:`IndependentHyperConnection` pairs: h + post * f(norm(collapsed)), in fp32."""

    def forward(self, h_BTND: Tensor, positions_BT: Tensor, cache=None, slots=None, kv_len=None) -> Tensor:
        post, x = self.attn_hc(h_BTND)
        h_BTND = _independent_residual(h_BTND, post, self.self_attn(self.input_layernorm(x), positions_BT, cache, slots,
                                                                     kv_len))
        post, x = self.ffn_hc(h_BTND)
        return _independent_residual(h_BTND, post, self.mlp(self.post_attention_layernorm(x)))


def _independent_residual(h_BTND: Tensor, post: Tensor, out_BTD: Tensor) -> Tensor:
    return (post.float().unsqueeze(-1) * out_BTD.float().unsqueeze(-2) + h_BTND.float()).to(h_BTND.dtype)


class _HyperHead(nn.Module):
    """``hc_fn`` [N, N D], ``hc_base`` [N], ``hc_scale`` [1] (fp32): the streams' final collapse."""

    def __init__(self, hidden_size: int, streams: int):
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(streams, streams * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(streams, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))


class HyperHeadNorm(RMSNorm):
    """The streams [B, T, N, D] collapsed by sigmoid weights from ``hc_head`` (of the RMS-normalised streams), then
    the model's RMSNorm (an fp32 weight with ``weight_in_fp32``: DeepSeek-V4; else the model's dtype: Hy4)."""

    def __init__(self, hidden_size: int, streams: int, eps: float, hc_eps: float, weight_in_fp32: bool = False,
                 dtype=None):
        super().__init__(hidden_size, eps, weight_in_fp32=weight_in_fp32,
                         dtype=torch.float32 if weight_in_fp32 else dtype)
        self.hc_head, self.hc_eps = _HyperHead(hidden_size, streams), hc_eps

    def forward(self, h: Tensor) -> Tensor:
        head = self.hc_head
        mixes = F.linear(rms_unweighted(h.flatten(-2).float(), self.eps), head.hc_fn.float())
        pre = torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + self.hc_eps
        return super().forward((pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype))


class StreamRMSNorm(nn.Module):
    """A zero-centred RMSNorm of each stream's D channels, one weight [N D] over all streams (Qwen4-Exp's grouped
    ``hc_norm`` / PLE norms): y_n = (x_n / rms(x_n) * (1 + w_n)) in fp32, cast back. ``forward(x [..., N, D])``."""

    def __init__(self, streams: int, hidden_size: int, eps: float, dtype=None):
        super().__init__()
        self.streams, self.eps = streams, eps
        self.weight = nn.Parameter(torch.zeros(streams * hidden_size, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float().view(self.streams, -1))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, {tuple(self.weight.shape)}, eps={self.eps}"


class GatedStreamMixer(nn.Module):
    """Qwen4-Exp's gated residual around a sublayer (transformers' Qwen4ExpTextGatedResidual; names as its):
    ``hc_norm`` (:class:`StreamRMSNorm`), ``input_mix_weight_down`` [r, N D], ``input_mix_weight_up`` [N D, r],
    ``block_inject_weight`` [N, N D] (None: the final collapse, ``inject`` False).

    ``forward(h [B, T, N, D]) -> (x [B, T, D], inject [B, T, N])``, or x alone for the final collapse: x =
    mean_n(sigmoid(up(silu(down(hn) / N)))_n * hn_n) with hn = hc_norm(h); inject = 2 sigmoid(block_inject_weight(hn) /
    N). :meth:`residual` adds a sublayer's output back: h + inject_n * out."""

    def __init__(self, hidden_size: int, streams: int, rank: int, eps: float, inject: bool = True, dtype=None):
        super().__init__()
        N, D = streams, hidden_size
        self.streams = N
        self.hc_norm = StreamRMSNorm(N, D, eps, dtype=dtype)
        self.input_mix_weight_down = nn.Linear(N * D, rank, bias=False, dtype=dtype)
        self.input_mix_weight_up = nn.Linear(rank, N * D, bias=False, dtype=dtype)
        self.block_inject_weight = nn.Linear(N * D, N, bias=False, dtype=dtype) if inject else None

    def forward(self, h_BTND: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        N = self.streams
        hn = self.hc_norm(h_BTND)
        flat = hn.flatten(-2)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(flat) / N)))
        x = (gate.view_as(hn) * hn).mean(dim=-2)
        if self.block_inject_weight is None:
            return x
        return x, 2 * torch.sigmoid(self.block_inject_weight(flat) / N)

    @staticmethod
    def residual(h_BTND: Tensor, inject_BTN: Tensor, out_BTD: Tensor) -> Tensor:
        return h_BTND + out_BTD.unsqueeze(-2) * inject_BTN.unsqueeze(-1)
