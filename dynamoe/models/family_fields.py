"""Fields and per-layer sizes that one family's config holds beyond :class:`~dynamoe.models.config.ModelConfig`'s
typed fields, parsed from ``ModelConfig.raw`` as its transformers configuration class reads them: Inkling's
and Inkling-2's attention sizes (and Inkling-2-Loop's loop), Qwen4-Exp's hyper-connection / QSA / n-gram fields,
Gemma 4's per-layer attention sizes. The family modules and ModelConfig's cache sizing read them here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config_values import _bool, _err, _int, _int_list, _str

if TYPE_CHECKING:
    from .config import ModelConfig

__all__ = ["INKLING_TYPES", "inkling_attention_sizes", "Qwen4Fields", "qwen4_fields", "LoopLayers",
           "inkling2_loop_layers", "inkling_cache_sizes", "Gemma4Layer", "gemma4_attention_layers"]


#: Inkling's and Inkling-2's language models: the sliding layers' own sizes, four conv windows per layer
INKLING_TYPES = ("inkling_text", "inkling2_text", "inkling2_loop_text")


def inkling_attention_sizes(cfg: "ModelConfig") -> tuple:
    """Inkling's (query heads, KV heads, head dim) per layer: the sliding layers' from ``swa_num_attention_heads`` /
    ``swa_num_key_value_heads`` / ``swa_head_dim``, the full ones' from the plain fields."""
    d = cfg.raw
    swa = (_int(d, "swa_num_attention_heads", required=True), _int(d, "swa_num_key_value_heads", required=True),
           _int(d, "swa_head_dim", required=True))
    if swa[0] % swa[1]:
        raise _err("swa_num_key_value_heads", swa[1], f"a divisor of swa_num_attention_heads={swa[0]}")
    full = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    return tuple(swa if t == "sliding_attention" else full for t in cfg.layer_types)


@dataclass(frozen=True)
class Qwen4Fields:
    """Qwen4-Exp's own values (:func:`qwen4_fields`): hyper-connection streams and the mixers' rank; the QSA block size
    (its heads, head size and token budget are ``index_n_heads`` / ``index_head_dim`` / ``index_topk``); the per-layer
    n-gram embeddings (PLE: 0-based ``ple_layers``, empty for none; ``ple_eos``, the token their n-grams restart after,
    None without PLE) and the linear attention's output-gate activation.
    """

    hc_count: int
    hc_lowrank: int
    indexer_compress_ratio: int
    output_gate_type: str
    ple_layers: tuple
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int
    ple_eos: int | None


def qwen4_fields(cfg: "ModelConfig") -> Qwen4Fields:
    """Qwen4-Exp's fields as Qwen4ExpTextConfig reads and checks them (defaults: 4 streams, rank 320, no PLE, PLE
    embedding width = hidden size, conv kernel 4, trigrams, 8 heads per n-gram, 20M n-gram vocabulary base padded to
    multiples of 128, seed 1234, 512 checkpoint shards per table). The QSA fields are required together (transformers'
    attention layers cannot be built without them)."""
    d, layers = cfg.raw, cfg.num_hidden_layers
    hc_count = _int(d, "hc_count", 4, minimum=2)
    qsa = {"indexer_n_heads": cfg.index_n_heads, "indexer_head_dim": cfg.index_head_dim, "indexer_budget": cfg.index_topk,
           "indexer_compress_ratio": _int(d, "indexer_compress_ratio"), "indexer_kv_heads": _int(d, "indexer_kv_heads")}
    missing = [k for k, v in qsa.items() if v is None]
    if missing and "indexed_attention" in cfg.layer_types:
        raise ValueError(f"config fields {missing} are required: the 'indexed_attention' layers of {cfg.model_type!r} "
                         "select their keys with the QSA indexer, which needs all of indexer_n_heads, indexer_kv_heads, "
                         "indexer_head_dim, indexer_budget and indexer_compress_ratio")
    ratio = qsa["indexer_compress_ratio"] or 1
    if qsa["indexer_kv_heads"] not in (None, 1):
        raise _err("indexer_kv_heads", qsa["indexer_kv_heads"], "1 (Qwen4-Exp's QSA has one key head)")
    if qsa["indexer_budget"] is not None and qsa["indexer_budget"] % ratio:
        raise _err("indexer_budget", qsa["indexer_budget"], f"a multiple of indexer_compress_ratio={ratio}")
    rotary = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    if qsa["indexer_head_dim"] is not None and rotary > qsa["indexer_head_dim"]:
        raise _err("indexer_head_dim", qsa["indexer_head_dim"], f"an int >= the attention's rotary dims ({rotary}: "
                   "the indexer's queries and keys take the same RoPE)")
    gate = _str(d, "output_gate_type", None) or cfg.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise _err("output_gate_type", gate, "'silu' or 'sigmoid' (default: hidden_act)")
    ids = d.get("ple_layer_ids")
    if ids is None:
        ids = []
    if (not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
            or any(not 1 <= i <= layers for i in ids)):
        raise _err("ple_layer_ids", ids, f"a list of one-based layer ids in [1, {layers}]")
    ple = tuple(sorted({i - 1 for i in ids}))
    bad = [i + 1 for i in ple if cfg.layer_types[i] != "linear_attention"]
    if bad:
        raise _err("ple_layer_ids", ids, f"ids of 'linear_attention' layers only (layers {bad} are not)")
    ngram, heads = _int(d, "ngram_size", 3, minimum=2), _int(d, "heads_per_ngram", 8)
    width = _int(d, "ple_embed_dim", cfg.hidden_size)
    # (the text config's own eos when a wrapper nests it: transformers' text model reads its config's, whatever the
    # wrapper's says)
    eos = _int_list(d, "text_eos_token_id") if "text_eos_token_id" in d else cfg.eos_token_id
    if ple:
        if width % ((ngram - 1) * heads):
            raise _err("ple_embed_dim", width, f"a multiple of (ngram_size - 1) * heads_per_ngram = {(ngram - 1) * heads}")
        if not eos:
            raise ValueError("config field 'eos_token_id' is required when ple_layer_ids is set (the n-gram "
                             "embeddings restart after it)")
    return Qwen4Fields(hc_count, _int(d, "hc_lowrank", 320), ratio, gate, ple, width,
                       _int(d, "ple_conv_kernel_size", 4), ngram, heads, _int(d, "ngram_vocab_size_base", 20_000_000),
                       _int(d, "make_ngram_vocab_size_divisible_by", 128), _int(d, "seed", 1234, minimum=0),
                       _int(d, "split_ngram_parts", 512), eos[0] if ple else None)


@dataclass(frozen=True)
class LoopLayers:
    """Inkling-2-Loop's loop: layers ``start``..``end`` - 1 run ``passes`` times; ``gate_rank`` the message gates'."""

    start: int
    end: int
    passes: int
    gate_rank: int

    @property
    def extra_layers(self) -> int:
        """Layer runs beyond the model's layers (each with its own cache layer): the loop's, once per extra pass."""
        return (self.passes - 1) * (self.end - self.start)


def inkling2_loop_layers(cfg: "ModelConfig") -> LoopLayers:
    """Inkling-2-Loop's loop (Inkling2LoopTextConfig's rules): ``loop_layer_index_start`` / ``_end`` /
    ``loop_num_passes`` / ``loop_gate_rank``, the hub's ``loop_config`` (``core_start``, ``core_end``, ``num_passes``,
    ``gate_rank``) winning where given; start > 0 and both ends multiples of ``n_layers_per_attn_res_block``."""
    d = dict(cfg.raw)
    loop = d.get("loop_config")
    if loop is not None:
        if not isinstance(loop, dict):
            raise _err("loop_config", loop, "a dict (core_start, core_end, num_passes, gate_rank)")
        for ours, theirs in (("loop_layer_index_start", "core_start"), ("loop_layer_index_end", "core_end"),
                             ("loop_num_passes", "num_passes"), ("loop_gate_rank", "gate_rank")):
            if loop.get(theirs) is not None:
                d[ours] = loop[theirs]
    block = _int(d, "n_layers_per_attn_res_block", 6)
    start, end = _int(d, "loop_layer_index_start", 6), _int(d, "loop_layer_index_end", 18, minimum=0)
    passes, rank = _int(d, "loop_num_passes", 3), _int(d, "loop_gate_rank", 64)
    n = cfg.num_hidden_layers
    if start % block:
        raise _err("loop_layer_index_start", start, f"a multiple of n_layers_per_attn_res_block={block}, > 0")
    if end % block or not start <= end <= n:
        raise _err("loop_layer_index_end", end, f"a multiple of n_layers_per_attn_res_block={block} in "
                   f"[loop_layer_index_start={start}, num_hidden_layers={n}]")
    return LoopLayers(start, end, passes, rank)


def inkling_cache_sizes(cfg: "ModelConfig") -> tuple:
    """:func:`inkling_attention_sizes` of every cache layer: the model's layers, then (Inkling-2-Loop) the loop
    layers' once for each pass after the first."""
    sizes = inkling_attention_sizes(cfg)
    if cfg.family_type != "inkling2_loop_text":
        return sizes
    loop = inkling2_loop_layers(cfg)
    return sizes + sizes[loop.start:loop.end] * (loop.passes - 1)


@dataclass(frozen=True)
class Gemma4Layer:
    """One Gemma 4 attention layer's sizes: ``head_dim`` and ``num_key_value_heads`` (the full layers' differ:
    per_layer_config), and ``kv_source``, the layer whose keys and values it attends over -- itself, or for the last
    ``num_kv_shared_layers`` layers the last earlier layer of its kind that computes its own."""

    head_dim: int
    num_key_value_heads: int
    kv_source: int


_GEMMA4_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def gemma4_attention_layers(cfg: "ModelConfig") -> tuple:
    """Gemma 4's per-layer attention sizes (:class:`Gemma4Layer` per layer) as Gemma4TextConfig derives them:
    ``per_layer_config`` (layer index -> overrides of head_dim / num_key_value_heads) when the file has one, else
    the full layers get ``global_head_dim`` (512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` KV
    heads; layers of one kind must agree (their RoPE is one table). KV sharing: the last ``num_kv_shared_layers``
    reuse the keys and values of the last earlier layer of their kind."""
    d, n, types = cfg.raw, cfg.num_hidden_layers, cfg.layer_types
    over: dict = {}
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        glob = {"head_dim": _int(d, "global_head_dim", 512)}
        if _bool(d, "attention_k_eq_v", False) and d.get("num_global_key_value_heads") is not None:
            glob["num_key_value_heads"] = _int(d, "num_global_key_value_heads")
        over = {i: glob for i, t in enumerate(types) if t == "full_attention"}
    else:
        if not isinstance(per_layer, dict):
            raise _err("per_layer_config", per_layer, "a dict of layer index -> overrides")
        for key, fields in per_layer.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                i = -1
            if not 0 <= i < n or not isinstance(fields, dict):
                raise _err("per_layer_config", per_layer, f"a dict of layer indices in [0, {n}) -> dicts of overrides")
            bad = sorted(set(fields) - set(_GEMMA4_LAYER_FIELDS))
            if bad:
                raise _err(f"per_layer_config.{key}", fields, f"overrides of {list(_GEMMA4_LAYER_FIELDS)} only (dynamoe "
                           f"does not build other per-layer differences; got {bad})")
            over[i] = {f: _int(fields, f, required=True) for f in fields}
    shared = _int(d, "num_kv_shared_layers", 0, minimum=0) or 0
    if shared >= n:
        raise _err("num_kv_shared_layers", shared, f"an int < num_hidden_layers={n} (some layer must compute the keys "
                   "and values the others share)")
    first = n - shared
    out, by_kind = [], {}
    for i, t in enumerate(types):
        o = over.get(i, {})
        hd, kv = o.get("head_dim", cfg.head_dim), o.get("num_key_value_heads", cfg.num_key_value_heads)
        if cfg.num_attention_heads % kv:
            raise _err(f"num_key_value_heads of layer {i}", kv, f"a divisor of num_attention_heads={cfg.num_attention_heads}")
        if by_kind.setdefault(t, (hd, kv)) != (hd, kv):
            raise _err("per_layer_config", per_layer, f"one head_dim / num_key_value_heads for all {t!r} layers "
                       f"(layer {i} has {(hd, kv)}, an earlier one {by_kind[t]})")
        src = i
        if i >= first:
            earlier = [j for j in range(first) if types[j] == t]
            if not earlier:
                raise _err("num_kv_shared_layers", shared, f"a count that leaves a {t!r} layer before the shared ones "
                           f"(layer {i} would share one)")
            src = earlier[-1]
        out.append(Gemma4Layer(hd, kv, src))
    return tuple(out)
