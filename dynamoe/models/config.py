"""A checkpoint's ``config.json`` parsed once into typed dataclasses (:class:`ModelConfig`, :class:`RopeConfig`).

Both config styles are accepted and give the same result:

* hub style: ``rope_theta`` at the top, ``rope_scaling: {type | rope_type, factor, ...}`` (or null);
* transformers-5 style: ``rope_parameters: {rope_type, rope_theta, factor, ...}``.

The expert count is read from ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``
(whichever is present). Fields that only some families use (DeepSeek's MLA ranks, GLM's groups, the
V3.2 indexer) are parsed here too, so a family module reads typed values, never the raw dict; the raw
dict stays on ``ModelConfig.raw`` for anything a later family needs before it gets a typed field.

A multimodal wrapper's config (:data:`TEXT_WRAPPERS`: Kimi-K2.5, Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V,
Qwen3-Omni, ...) nests its language model under ``text_config`` (Qwen3-Omni: ``thinker_config.text_config``):
:func:`unwrap_text_config` flattens it, one path for every wrapper, and the result parses as the text model
(``text_config_nested`` records that its weights sit where the wrapper keeps them).

Family defaults that transformers applies in its config classes (``rms_norm_eps``, expert counts and
top-k, ``max_position_embeddings``, GPT-OSS's YaRN, ``swiglu_limit`` and alternating sliding layers,
per-family ``rope_theta``, ...) live in :data:`dynamoe.models.family_defaults.FAMILY_DEFAULTS`, so a config.json that omits them
parses as transformers reads it (tests/test_models_config_defaults.py compares every field).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from .family_defaults import FAMILY_DEFAULTS
from .config_values import _bool, _err, _float, _int, _int_list, _str, _str_list
from .family_fields import INKLING_TYPES, gemma4_attention_layers, inkling_cache_sizes, qwen4_fields
from .unsupported import refusal

log = logging.getLogger(__name__)

__all__ = ["ModelConfig", "RopeConfig", "SSMConfig", "NEMOTRON_BLOCKS", "ROPE_TYPES", "LAYER_TYPES", "MLP_LAYER_TYPES", "INDEXER_TYPES", "parse_rope",
           "TEXT_WRAPPERS", "TextWrapper", "unwrap_text_config"]

# 'proportional' (Gemma 4's global layers): RoPE over the whole head whose first partial_rotary_factor share of
# frequency pairs rotate (exponents over the whole head dim) and the rest stand still
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")
# 'chunked_attention' (Llama-4's local attention within chunks of attention_chunk_size positions) is a layer type
# of the families that build it only (their FAMILY_DEFAULTS entry says "chunked_layers"): anywhere else it is
# refused, not read as full attention
# 'indexed_attention': DeepSeek-V3.2 / GLM-5 MLA with the sparse-attention indexer (full causal otherwise);
# 'linear_attention': Qwen3-Next / Qwen3.5 Gated DeltaNet (a recurrent state per sequence, no KV cache)
LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention", "linear_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

@dataclass(frozen=True)
class TextWrapper:
    """How a multimodal wrapper's config.json holds its language model (see :func:`unwrap_text_config`).

    ``path``: the sub-config keys from the top level down to the text model's config; ``text_types``: the
    text model types it may hold (the first is the default when that config names none); ``tie_default``:
    the wrapper config class's ``tie_word_embeddings`` when the file omits it (the flag of the level right
    above the text config ties the wrapper's lm_head in transformers); ``tie_from_text``: a text config's
    own ``tie_word_embeddings: true`` ties too (GLM-4.5V's rule for configs saved before transformers 5);
    ``tie_by_text``: only the text config's own flag decides (default false), the wrapper's is not read
    (Llama-4: its language model is a model of its own that ties by its own config)."""

    path: tuple
    text_types: tuple
    tie_default: bool = False
    tie_from_text: bool = False
    tie_by_text: bool = False
    #: a key older configs nest the text model under instead of ``path`` (one level; read when ``path`` is absent or
    #: null, whatever model_type it says: the wrapper's text config class takes it as its own), and fields those
    #: configs keep on the wrapper that belong to the text model
    legacy_key: str = ""
    legacy_fields: tuple = ()


#: multimodal checkpoints whose config.json nests the text model (dynamoe loads the text model only):
#: outer model_type -> where and what it is
TEXT_WRAPPERS: dict[str, TextWrapper] = {
    "kimi_k25": TextWrapper(("text_config",), ("deepseek_v3", "kimi_k2"), tie_default=True),
    "qwen3_5_moe": TextWrapper(("text_config",), ("qwen3_5_moe_text",)),
    "qwen3_vl_moe": TextWrapper(("text_config",), ("qwen3_vl_moe_text",)),
    "glm4v_moe": TextWrapper(("text_config",), ("glm4v_moe_text",), tie_from_text=True),
    "qwen3_omni_moe_thinker": TextWrapper(("text_config",), ("qwen3_omni_moe_text",)),
    "qwen3_omni_moe": TextWrapper(("thinker_config", "text_config"), ("qwen3_omni_moe_text",)),
    "llama4": TextWrapper(("text_config",), ("llama4_text",), tie_by_text=True),
    # (Step3p7ForConditionalGeneration ties by the wrapper's flag alone, default false)
    "step3p7": TextWrapper(("text_config",), ("step3p5",)),
    # (AriaForConditionalGeneration ties by the wrapper's flag alone, default false)
    "aria": TextWrapper(("text_config",), ("aria_text",)),
    "minimax_m3_vl": TextWrapper(("text_config",), ("minimax_m3_vl_text",)),
    "glm5_next": TextWrapper(("text_config",), ("glm5_next_text",)),
    "mistral_large4": TextWrapper(("text_config",), ("mistral_large4_text",)),
    "dots3_note": TextWrapper(("text_config",), ("dots3_note_text",)),
    "hy_v4_vl": TextWrapper(("text_config",), ("hy_v4_vl_text",)),
    # (Qwen4ExpForConditionalGeneration ties by the wrapper's flag, default false)
    "qwen4_exp": TextWrapper(("text_config",), ("qwen4_exp_text",)),
    # (DeepseekOcr2ForConditionalGeneration ties by the wrapper's flag, default false)
    "deepseek_ocr2": TextWrapper(("text_config",), ("deepseek_ocr2_text",)),
    # (UnlimitedOcrForConditionalGeneration ties by the wrapper's flag, default false; the hub's config nests the text
    # model under language_config and keeps sliding_window on the wrapper, as UnlimitedOcrConfig reads it)
    "unlimited_ocr": TextWrapper(("text_config",), ("unlimited_ocr_text",), legacy_key="language_config",
                                 legacy_fields=("sliding_window",)),
    # (Ernie4_5_VLMoeForConditionalGeneration ties by the wrapper's flag, default true)
    "ernie4_5_vl_moe": TextWrapper(("text_config",), ("ernie4_5_vl_moe_text",), tie_default=True),
    # (MuseSparkConfig has no tie flag: its text config's decides)
    "muse_spark": TextWrapper(("text_config",), ("muse_spark_text",), tie_by_text=True),
    # (InklingForConditionalGeneration never ties: inkling_text ignores the flag)
    "inkling_mm_model": TextWrapper(("text_config",), ("inkling_text",)),
    # (Inkling2ForConditionalGeneration never ties: inkling2_text ignores the flag)
    "inkling2": TextWrapper(("text_config",), ("inkling2_text",)),
    "inkling2_loop": TextWrapper(("text_config",), ("inkling2_loop_text",)),
    # (Gemma4ForConditionalGeneration ties by the wrapper's flag, default true)
    "gemma4": TextWrapper(("text_config",), ("gemma4_text",), tie_default=True),
    # Nemotron-3-Nano-Omni (NemotronH_Omni_Reasoning_V3): its language model is a NemotronHForCausalLM, which never
    # ties (nemotron_h ignores the flag); released configs nest it under llm_config (the config class's legacy name)
    "nemotron_h_omni": TextWrapper(("text_config",), ("nemotron_h",), legacy_key="llm_config"),
    # Nemotron-3.5-Transcribe (Nemotron3_5TranscribeForConditionalGeneration never ties: no tied weights)
    "nemo_speechlm": TextWrapper(("text_config",), ("nemotron_h",)),
}
#: fields that describe the whole checkpoint: the outermost level that gives one wins (as transformers'
#: generation config reads token ids: the wrapper's, else its text config's)
_WRAPPER_FIELDS = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id")

# layer kinds whose (uncompressed) keys are a sliding window of sliding_window positions
_WINDOWED = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_LINEAR_ATTENTION_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                            "linear_num_key_heads", "linear_num_value_heads")

# ------------------------------------------------------------------------------------------ checks


def _indexer_types(d: dict, layers: int) -> tuple:
    """GLM-5's per-layer indexer kinds, as transformers' GlmMoeDsaConfig derives them: ``indexer_types``,
    else ``index_topk_pattern`` ('F' full / 'S' shared per layer), else ``index_topk_freq`` with
    ``index_skip_topk_offset`` (layer i is full when max(i - offset + 1, 0) % freq == 0). () = all full."""
    if d.get("indexer_types") is not None:
        return _str_list(d, "indexer_types", layers, INDEXER_TYPES)
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if any(c not in "FS" for c in pattern):
                raise _err("index_topk_pattern", pattern, "a string of 'F' (full) and 'S' (shared)")
            pattern = [{"F": "full", "S": "shared"}[c] for c in pattern]
        return _str_list({"index_topk_pattern": pattern}, "index_topk_pattern", layers, INDEXER_TYPES)
    if d.get("index_topk_freq") is None and d.get("index_skip_topk_offset") is None:
        return ()
    freq = max(_int(d, "index_topk_freq", 1, minimum=0), 1)
    offset = _int(d, "index_skip_topk_offset", 2, minimum=0)
    types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))
    return () if all(t == "full" for t in types) else types


def _llama4_rope_layers(d: dict, layers: int) -> tuple:
    """Llama-4's per-layer RoPE switch as Llama4TextConfig derives it: ``no_rope_layers`` (1 = RoPE, 0 = NoPE;
    empty or null: the default), else NoPE on every ``no_rope_layer_interval``-th layer."""
    v = d.get("no_rope_layers")
    if not v:
        every = _int(d, "no_rope_layer_interval")
        return tuple(int((i + 1) % every != 0) for i in range(layers))
    if (not isinstance(v, (list, tuple)) or len(v) < layers
            or any(not isinstance(x, (int, float)) or x not in (0, 1) for x in v)):
        raise _err("no_rope_layers", v, f"a list of at least {layers} entries, each 1 (RoPE) or 0 (NoPE)")
    return tuple(int(x) for x in v[:layers])


def _kimi_layer_types(linear_attn_config: dict, layers: int) -> tuple:
    """Kimi-Linear's layer kinds as KimiLinearConfig derives them: the 1-based ``full_attn_layers`` and
    ``kda_layers`` of ``linear_attn_config`` when it has both (every layer in one of them), else full
    attention on layers 4, 8, ... (0-based) and KDA on the others."""
    if not isinstance(linear_attn_config, dict):
        raise _err("linear_attn_config", linear_attn_config, "a dict")
    full, kda = linear_attn_config.get("full_attn_layers"), linear_attn_config.get("kda_layers")
    if full is None or kda is None:
        return tuple("full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers))
    types = [None] * layers
    for name, ids, kind in (("full_attn_layers", full, "full_attention"), ("kda_layers", kda, "linear_attention")):
        if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= layers
                                                     for i in ids):
            raise _err(f"linear_attn_config.{name}", ids, f"a list of 1-based layer numbers in [1, {layers}]")
        for i in ids:
            types[i - 1] = kind
    if None in types:
        raise _err("linear_attn_config", {"full_attn_layers": full, "kda_layers": kda},
                   f"full_attn_layers and kda_layers that together name every layer 1..{layers}")
    return tuple(types)


def _linear_and_indexed(d: dict, layer_types, layers: int, every: int | None) -> tuple:
    """Layer kinds of the hybrids of linear attention and indexed (sparse) attention, GLM-5.3's and Qwen4-Exp's:
    ``layer_types`` as given, with 'full_attention' read as 'indexed_attention' (their configs name the indexed
    layers so), or by default (``every``) every ``every``-th layer indexed and the others linear."""
    if layer_types is None:
        layer_types = ["indexed_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    if isinstance(layer_types, (list, tuple)):
        layer_types = ["indexed_attention" if t == "full_attention" else t for t in layer_types]
    if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
            or any(t not in ("linear_attention", "indexed_attention") for t in layer_types)):
        raise _err("layer_types", d.get("layer_types"), f"a list of {layers} entries from ['linear_attention', "
                   "'indexed_attention', 'full_attention']")
    return tuple(layer_types)


def _ropes_by_layer_type(d: dict, max_pos: int, defaults: dict, layer_types: tuple,
                         partial_default: float | None = None, nope_kinds: bool = False) -> tuple:
    """MiMo-V2-Flash: ``rope_parameters`` nested by layer type (``{"full_attention": {...}, "sliding_attention":
    {...}}``; absent or null: ``defaults``) as ((layer type, RopeConfig), ...), each parsed from its own dict
    alone (top-level rope_theta / partial_rotary_factor are not read, as MiMoV2FlashConfig), the partial
    factor defaulting to the family's (``partial_default`` when given: Laguna reads a missing one as 1, whatever
    its defaults say); every layer type in ``layer_types`` must have one. ``nope_kinds``: a kind may map to null (no
    RoPE on its layers: Beam's full layers), left out of the result."""
    params = d.get("rope_parameters")
    if params is None:
        params = defaults
    if not isinstance(params, dict) or not params or any(t not in LAYER_TYPES or not (
            isinstance(p, dict) or (nope_kinds and p is None)) for t, p in params.items()):
        raise _err("rope_parameters", params, f"a dict of RoPE parameters per layer type ({list(defaults)})")
    missing = sorted(set(layer_types) - set(params))
    if missing:
        raise _err("rope_parameters", params, f"RoPE parameters for every layer type in layer_types (missing {missing})")
    out = []
    for kind, p in params.items():
        if p is None:
            continue
        partial = (defaults.get(kind, {}).get("partial_rotary_factor", 1.0) if partial_default is None
                   else partial_default)
        out.append((kind, parse_rope({"rope_parameters": p}, max_pos, 10000.0, None, partial)))
    return tuple(out)


_STEP_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
                         "partial_rotary_factors")


_DOTS3_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "moe_layer_freq")


def _step_trim_mtp(d: dict, layers: int, lists: tuple = _STEP_PER_LAYER_LISTS) -> dict:
    """Per-layer lists (Step-3.5's :data:`_STEP_PER_LAYER_LISTS`, dots3_note's :data:`_DOTS3_PER_LAYER_LISTS`)
    padded with one trailing entry per multi-token-prediction layer (``num_nextn_predict_layers``), cut to the decoder
    layers as Step3p7TextConfig does; the cut entries kept under ``mtp_layer_entries`` (list name -> one entry per MTP
    layer: what those layers are, :mod:`dynamoe.models.step3p5`, :mod:`dynamoe.models.dots3_note`)."""
    mtp = _int(d, "num_nextn_predict_layers", 0, minimum=0) or 0
    if not mtp:
        return d
    d = dict(d)
    kept = {}
    for name in lists:
        v = d.get(name)
        if isinstance(v, (list, tuple)) and len(v) == layers + mtp:
            d[name], kept[name] = list(v[:layers]), list(v[layers:])
    if kept:
        d["mtp_layer_entries"] = kept
    return d


def _step_mlp_types(d: dict, layers: int) -> tuple:
    """Step-3.5's MLP kinds without ``mlp_layer_types``: MoE on the hub's ``moe_layers_enum`` (a comma-separated
    string or a list of layer indices), else on every layer from 3 (Step3p7TextConfig's rule)."""
    enum = d.get("moe_layers_enum")
    if enum is None:
        moe = set(range(3, layers))
    else:
        items = enum.split(",") if isinstance(enum, str) else enum
        try:
            if not isinstance(items, (list, tuple)) or any(isinstance(i, bool) for i in items):
                raise ValueError
            moe = {int(i) for i in items if str(i).strip()}
        except ValueError:
            raise _err("moe_layers_enum", enum, "a comma-separated string or a list of layer indices") from None
    return tuple("sparse" if i in moe else "dense" for i in range(layers))


def _step_ropes(d: dict, max_pos: int, layer_types: tuple) -> tuple:
    """Step-3.5's RoPE per layer type as ((layer type, RopeConfig), ...), as Step3p7TextConfig derives it:
    ``rope_parameters`` nested by layer type (what transformers saves; one dict for every layer kind of
    ``layer_types``), else each kind's from its first layer's entry of the hub's ``rope_theta`` (one number, or
    one per layer; default 1e4) and ``partial_rotary_factors`` (one per layer; default: the whole head), the
    full-attention kind updated with ``rope_scaling``. A single (not nested) rope_parameters dict is refused:
    transformers' config class ignores it (it would read the hub's fields instead)."""
    kinds = sorted(set(layer_types), key=layer_types.index)
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not all(isinstance(params.get(k), dict) for k in kinds):
            raise _err("rope_parameters", params, f"a dict of RoPE parameters for each layer type {kinds} (Step-3.5 "
                       "nests them by layer type; a single dict is not read by transformers either)")
        return tuple((k, parse_rope({"rope_parameters": params[k]}, max_pos)) for k in kinds)
    n = len(layer_types)
    theta = d.get("rope_theta", 10000.0)
    thetas = theta if isinstance(theta, (list, tuple)) else [theta] * n
    partials = d.get("partial_rotary_factors")
    if len(thetas) != n:
        raise _err("rope_theta", theta, f"a number or a list of {n} numbers (one per layer)")
    if partials is not None and (not isinstance(partials, (list, tuple)) or len(partials) != n):
        raise _err("partial_rotary_factors", partials, f"a list of {n} numbers (one per layer)")
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise _err("rope_scaling", scaling, "a dict or null")
    out = []
    for k in kinds:
        i = layer_types.index(k)
        p = {"rope_type": "default", "rope_theta": thetas[i]}
        if partials is not None:
            p["partial_rotary_factor"] = partials[i]
        if k == "full_attention" and scaling:
            p.update(scaling)
        out.append((k, parse_rope({"rope_parameters": p}, max_pos)))
    return tuple(out)


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_V4_COMPRESS_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _v4_layer_types(d: dict, layers: int) -> tuple:
    """DeepSeek-V4's attention kinds as DeepseekV4Config derives them: ``layer_types`` (at least num_hidden_layers
    entries, cut to them), else the hub's per-layer ``compress_ratios`` (0 / 4 / 128), else two heavily compressed
    layers, then compressed-sparse and heavily compressed alternating."""
    v, name = d.get("layer_types"), "layer_types"
    if v is None and d.get("compress_ratios") is not None:
        v, name = d["compress_ratios"], "compress_ratios"
        if not isinstance(v, (list, tuple)) or any(isinstance(r, bool) or r not in _V4_COMPRESS_RATIO_KINDS for r in v):
            raise _err(name, v, f"a list of compress ratios from {sorted(_V4_COMPRESS_RATIO_KINDS)} (one per layer)")
        v = [_V4_COMPRESS_RATIO_KINDS[r] for r in v]
    if v is None:
        return (("heavily_compressed_attention",) * min(layers, 2)
                + tuple("compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                        for i in range(max(layers - 2, 0))))
    if not isinstance(v, (list, tuple)) or len(v) < layers or any(t not in V4_LAYER_TYPES for t in v):
        raise _err(name, v, f"a list of at least {layers} entries from {list(V4_LAYER_TYPES)}")
    return tuple(v[:layers])


def _v4_ropes(d: dict, max_pos: int, head_dim: int) -> tuple:
    """DeepSeek-V4's two RoPEs as (("main", RopeConfig), ("compress", RopeConfig)), as DeepseekV4Config derives them:
    ``rope_parameters`` nested by those labels when it has both, else "main" a plain RoPE of base rope_theta and
    "compress" one of base compress_rope_theta with the file's rope_parameters / rope_scaling (YaRN: its attention
    factor 1 unless given); both on the ``partial_rotary_factor`` share of each head (default: the legacy
    qk_rope_head_dim / head_dim, else 64 / 512)."""
    partial = d.get("partial_rotary_factor")
    if partial is None:
        rope_dim = _int(d, "qk_rope_head_dim")
        partial = rope_dim / head_dim if rope_dim is not None else 64 / 512
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise _err("rope_parameters", params, "a dict or null")
    params = params or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return tuple((k, parse_rope({"rope_parameters": params[k]}, max_pos)) for k in ("main", "compress"))
    scaling = {k: v for k, v in params.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
    compress = {**scaling, "rope_theta": d.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    if "type" in compress and "rope_type" not in compress:
        compress["rope_type"] = compress.pop("type")
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return tuple((k, parse_rope({"rope_parameters": p}, max_pos)) for k, p in (("main", main), ("compress", compress)))


#: dots3_note's sliding layers' MLA sizes when config.json has no per_layer_config (Dots3NoteTextConfig's swa_* defaults)
_DOTS3_SWA = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
              "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}
#: the per-layer MLA sizes dynamoe reads (MLA has one KV head per query head: num_key_value_heads is accepted, unused)
DOTS3_LAYER_FIELDS = tuple(k for k in _DOTS3_SWA if k != "num_key_value_heads") + ("qk_rope_head_dim",)


def _dots3_layer_types(d: dict, layers: int) -> tuple:
    """dots3_note's attention kinds as Dots3NoteTextConfig derives them: ``layer_types``, else DSA ('indexed_attention')
    on layers 0, 1 and every 4th from 1 and sliding elsewhere (all DSA without ``use_sliding_window``); ``use_dsa``
    false (default true, unset when the file has a per_layer_config) turns DSA into plain 'full_attention'."""
    use_dsa = d.get("use_dsa", None if "per_layer_config" in d else True)
    v = d.get("layer_types")
    if v is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        sliding = _bool(d, "use_sliding_window", True)
        v = [full if not sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(layers)]
    kinds = ("full_attention", "indexed_attention", "sliding_attention")
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(t not in kinds for t in v):
        raise _err("layer_types", v, f"a list of {layers} entries from {list(kinds)}")
    if use_dsa is not None:
        old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
        v = [new if t == old else t for t in v]
    return tuple(v)


def dots3_layer_sizes(d: dict, layer_types: tuple) -> tuple:
    """Each layer's MLA sizes ({field: value} over :data:`DOTS3_LAYER_FIELDS`) as Dots3NoteTextConfig's per-layer
    views give them: the file's ``per_layer_config`` entry (keyed by layer index) over the top-level fields; without
    a per_layer_config, the sliding layers take the ``swa_*`` fields (defaults :data:`_DOTS3_SWA`; their
    qk_rope_head_dim = head_dim - qk_nope_head_dim unless swa_qk_rope_head_dim)."""
    base = {k: d.get(k) for k in DOTS3_LAYER_FIELDS}
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        swa = {k: d.get(f"swa_{k}", v) for k, v in _DOTS3_SWA.items() if k in DOTS3_LAYER_FIELDS}
        swa["qk_rope_head_dim"] = d.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        per_layer = {str(i): swa for i, t in enumerate(layer_types) if t == "sliding_attention"}
    if not isinstance(per_layer, dict):
        raise _err("per_layer_config", per_layer, "a dict of per-layer overrides keyed by layer index")
    out = []
    for i in range(len(layer_types)):
        over = per_layer.get(str(i), per_layer.get(i, {}))
        if not isinstance(over, dict) or any(k not in DOTS3_LAYER_FIELDS + ("num_key_value_heads",) for k in over):
            raise _err(f"per_layer_config.{i}", over, f"a dict over {list(DOTS3_LAYER_FIELDS)} (and num_key_value_heads)")
        sizes = {k: v for k, v in {**base, **over}.items() if k in DOTS3_LAYER_FIELDS}
        if layer_types[i] == "sliding_attention" and isinstance(sizes["head_dim"], int) and (
                sizes["head_dim"] != (sizes["qk_nope_head_dim"] or 0) + (sizes["qk_rope_head_dim"] or 0)):
            raise _err(f"per_layer_config.{i}.head_dim", sizes["head_dim"], "qk_nope_head_dim + qk_rope_head_dim on a "
                       "sliding layer (as Dots3NoteTextConfig checks)")
        for k, v in sizes.items():
            _int(sizes, k, required=k != "q_lora_rank", minimum=1)
            if v is None and k == "q_lora_rank":
                raise ValueError(f"config field 'q_lora_rank' is required for every layer of dots3_note (layer {i})")
        out.append(sizes)
    return tuple(out)


def _dots3_ropes(d: dict, max_pos: int, layer_types: tuple) -> tuple:
    """dots3_note's RoPE per layer type as Dots3NoteTextConfig derives it: ``rope_parameters`` nested by layer type
    (or one dict for every type, or the hub's ``rope_scaling``), else base ``swa_rope_theta`` (5e4) on the sliding
    layers and ``rope_theta`` (8e7) on the others; each on the qk_rope_head_dim / head_dim share of its first layer."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    kinds = sorted(set(layer_types), key=layer_types.index)
    if params is None:
        params = {k: {"rope_type": "default", "rope_theta": d.get("swa_rope_theta", 50_000.0)
                      if k == "sliding_attention" else d.get("rope_theta", 80_000_000.0)} for k in kinds}
    if not isinstance(params, dict):
        raise _err("rope_parameters", params, "a dict")
    if not any(k in LAYER_TYPES for k in params):
        params = {k: dict(params) for k in kinds}
    sizes = dots3_layer_sizes(d, layer_types)
    out = []
    for k in kinds:
        p = params.get(k)
        if not isinstance(p, dict):
            raise _err("rope_parameters", params, f"RoPE parameters for every layer type (missing {k!r})")
        first = sizes[layer_types.index(k)]
        p = {**p, "partial_rotary_factor": first["qk_rope_head_dim"] / first["head_dim"]}
        out.append((k, parse_rope({"rope_parameters": p}, max_pos)))
    return tuple(out)


def _rotary_dim_factor(d: dict, head_dim: int) -> float:
    """MiniMax-M2: a hub config's ``rotary_dim`` (rotated dims per head) as a partial_rotary_factor, as
    transformers' MiniMaxM2Config converts it; 1.0 when absent (a saved rope_parameters or a top-level
    partial_rotary_factor still wins in parse_rope)."""
    rotary_dim = _int(d, "rotary_dim")
    if rotary_dim is None:
        return 1.0
    if rotary_dim > head_dim or rotary_dim % 2:
        raise _err("rotary_dim", rotary_dim, f"an even int <= head_dim={head_dim}")
    return rotary_dim / head_dim


# ------------------------------------------------------------------------------------------ RoPE
@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, whichever style the config used.

    rope_type: 'default' | 'linear' | 'dynamic' | 'yarn' | 'llama3' | 'longrope' | 'proportional' (Gemma 4: the
    whole head rotates as pairs (i, i + d/2), the first partial_rotary_factor share of the pairs at frequencies
    theta^(-2i/d) / factor, the others not at all; see rope.rotary_dims). theta: the base.
    factor: context scaling (linear, dynamic, yarn, llama3). original_max_position_embeddings: the
    pre-training length (yarn, llama3). beta_fast / beta_slow / truncate / mscale / mscale_all_dim /
    attention_factor: YaRN. low_freq_factor / high_freq_factor: llama3.
    partial_rotary_factor: fraction of each head's dims that rotate (GLM-4.5: 0.5).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    partial_rotary_factor: float = 1.0
    #: Llama-4's attention scaling (Mistral-4): queries times 1 + beta ln(1 + floor(position /
    #: original_max_position_embeddings)); None: not scaled
    llama_4_scaling_beta: Optional[float] = None
    #: longrope (Phi-3.5): per-frequency divisors of the base frequencies for sequences up to
    #: original_max_position_embeddings (short) and beyond (long), and the cos/sin scale of each (Phi-3.5-MoE)
    short_factor: tuple = ()
    long_factor: tuple = ()
    short_mscale: Optional[float] = None
    long_mscale: Optional[float] = None


def parse_rope(d: dict, max_position_embeddings: int, default_theta: float = 10000.0,
               family_default: Optional[dict] = None, default_partial: float = 1.0) -> RopeConfig:
    """RopeConfig from a config dict in either style (see the module docstring)."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = dict(family_default or {})
    if not isinstance(params, dict):
        raise _err("rope_parameters" if "rope_parameters" in d else "rope_scaling", params, "a dict or null")
    if any(k in LAYER_TYPES for k in params):
        raise ValueError(f"config field 'rope_parameters' nested per layer type ({sorted(params)}) is not supported; "
                         "supported: one rope_parameters dict for all layers")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _err("rope_type", rope_type, f"one of {list(ROPE_TYPES)}")
    theta = params.get("rope_theta", d.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial))
    merged = {**params, "rope_theta": theta, "partial_rotary_factor": partial}
    theta = _float(merged, "rope_theta", positive=True)
    partial = _float(merged, "partial_rotary_factor", positive=True)
    if partial > 1:
        raise _err("partial_rotary_factor", partial, "in (0, 1]")
    beta = _float(merged, "llama_4_scaling_beta")
    if rope_type == "default":
        return RopeConfig("default", theta, partial_rotary_factor=partial, llama_4_scaling_beta=beta,
                          original_max_position_embeddings=_int(merged, "original_max_position_embeddings"))
    if rope_type == "proportional":  # (factor: divides every frequency, default 1)
        return RopeConfig("proportional", theta, _float(merged, "factor", 1.0, positive=True),
                          partial_rotary_factor=partial, llama_4_scaling_beta=beta)
    orig = _int(merged, "original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if rope_type in ("yarn", "llama3") and orig is None:
        orig = max_position_embeddings  # transformers' standardize_rope_params does the same
    if rope_type == "longrope":
        lists = {}
        for name in ("short_factor", "long_factor"):
            v = merged.get(name)
            if (not isinstance(v, (list, tuple)) or not v
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in v)):
                raise _err(name, v, "a non-empty list of numbers > 0 (one per rotary frequency) for rope_type 'longrope'")
            lists[name] = tuple(float(x) for x in v)
        if orig is None:
            raise ValueError("config field 'original_max_position_embeddings' is required for rope_type 'longrope' "
                             "but missing")
        # transformers: factor defaults to max_position_embeddings / original, the attention factor to
        # sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)
        factor = _float(merged, "factor", positive=True) or max_position_embeddings / orig
        attention = _float(merged, "attention_factor", positive=True)
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeConfig("longrope", theta, factor, orig, attention_factor=attention,
                          short_mscale=_float(merged, "short_mscale", positive=True),
                          long_mscale=_float(merged, "long_mscale", positive=True),
                          partial_rotary_factor=partial, llama_4_scaling_beta=beta, **lists)
    factor = merged.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_position_embeddings / orig
    factor = _float({"factor": factor}, "factor", positive=True)
    if factor is None:
        raise ValueError(f"config field 'factor' is required for rope_type {rope_type!r} but missing")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            if merged.get(name) is None:
                raise ValueError(f"config field {name!r} is required for rope_type 'llama3' but missing")
    return RopeConfig(
        rope_type, theta, factor, orig,
        beta_fast=_float(merged, "beta_fast") or 32.0, beta_slow=_float(merged, "beta_slow") or 1.0,
        truncate=_bool(merged, "truncate", True), mscale=_float(merged, "mscale"),
        mscale_all_dim=_float(merged, "mscale_all_dim"), attention_factor=_float(merged, "attention_factor"),
        low_freq_factor=_float(merged, "low_freq_factor"), high_freq_factor=_float(merged, "high_freq_factor"),
        partial_rotary_factor=partial, llama_4_scaling_beta=beta,
    )


# ------------------------------------------------------------------------------------------ state-space layers
#: SSM layer kinds: 'mamba1' (Mamba's selective scan, a state per channel: Jamba), 'mamba2' (Mamba-2's
#: scalar decay per head: GraniteMoE-Hybrid, Nemotron-H) and 'short_conv' (LFM2's gated short convolution: a conv
#: window and no SSM state; state_size 0) and 'lightning' (MiniMax's linear attention with a fixed decay per head:
#: a [head_dim, head_dim] state per head, no conv; conv_kernel 1)
SSM_KINDS = ("mamba1", "mamba2", "short_conv", "lightning")


@dataclass(frozen=True)
class SSMConfig:
    """The recurrent layers' sizes of a family whose FAMILY_DEFAULTS entry names an "ssm" reader (its
    'linear_attention' layers -- Mamba, lightning attention -- or 'conv' layers), under one set of names whatever
    the config class calls them.

    ``intermediate_size``: the inner width (``expand`` x hidden_size); ``state_size``: N, the state per
    channel (Mamba-1) or per head dim (Mamba-2); ``conv_kernel``: the causal depthwise conv's width.
    Mamba-1: ``dt_rank`` (the low-rank time-step projection). Mamba-2: ``num_heads`` x ``head_dim`` =
    intermediate_size, ``n_groups`` (heads share B and C by group), ``chunk_size`` (the prefill's SSD
    chunk; any value gives the same numbers up to rounding), ``time_step_limit`` (dt clamped to it). Lightning
    attention: ``num_heads`` x ``head_dim`` (a [head_dim, head_dim] state per head: ``state_size`` = head_dim), no
    conv (``conv_kernel`` 1). Short convolution: hidden_size channels, ``conv_kernel`` taps, no state
    (``state_size`` 0)."""

    kind: str
    intermediate_size: int
    state_size: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    activation: str = "silu"
    dt_rank: Optional[int] = None
    num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    n_groups: int = 1
    chunk_size: int = 256
    time_step_limit: tuple = (0.0, math.inf)

    @property
    def conv_channels(self) -> int:
        """Channels of the conv (and of its cached window): x (Mamba-1); x, B and C (Mamba-2)."""
        return self.intermediate_size + (2 * self.n_groups * self.state_size if self.kind == "mamba2" else 0)

    @property
    def state_elements(self) -> int:
        """Elements of one layer's recurrent state per sequence."""
        return self.intermediate_size * self.state_size


def _json_float(x):
    """transformers saves a non-finite float in config.json as {"__float__": "Infinity"} (or "-Infinity", "NaN")."""
    if isinstance(x, dict) and set(x) == {"__float__"} and isinstance(x["__float__"], str):
        try:
            return float(x["__float__"])
        except ValueError:
            return x
    return x


def _time_step_limit(d: dict, name: str) -> tuple:
    v = d.get(name) if name else None
    if v is None:
        return (0.0, math.inf)
    if isinstance(v, (list, tuple)):
        v = [_json_float(x) for x in v]
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in v) or v[0] > v[1]):
        raise _err(name, v, "a pair [low, high] of numbers with low <= high")
    return (float(v[0]), float(v[1]))


def _parse_ssm(d: dict, reader: str, hidden: int) -> SSMConfig:
    """The :class:`SSMConfig` of a config dict whose family reads its Mamba sizes as ``reader`` says:
    'jamba' (JambaConfig's mamba_* names, Mamba-1 with dt_rank 'auto' = ceil(hidden / 16)); 'granite'
    (GraniteMoeHybridConfig's mamba_* names, Mamba-2 with mamba_d_head 'auto' = expand x hidden / heads);
    'nemotron' (NemotronHConfig's, Mamba-2 of mamba_num_heads x mamba_head_dim)."""
    if reader == "jamba":
        rank = d.get("mamba_dt_rank")
        rank = math.ceil(hidden / 16) if rank == "auto" else _int(d, "mamba_dt_rank", required=True)
        return SSMConfig("mamba1", _int(d, "mamba_expand", required=True) * hidden,
                         _int(d, "mamba_d_state", required=True), _int(d, "mamba_d_conv", required=True),
                         conv_bias=_bool(d, "mamba_conv_bias", True), proj_bias=_bool(d, "mamba_proj_bias", False),
                         activation=_str(d, "hidden_act", "silu"), dt_rank=rank)
    if reader == "granite":
        inner = _int(d, "mamba_expand", required=True) * hidden
        heads = _int(d, "mamba_n_heads", required=True)
        head_dim = inner // heads if d.get("mamba_d_head") == "auto" else _int(d, "mamba_d_head", required=True)
        if inner % heads or head_dim * heads != inner:
            raise _err("mamba_n_heads", heads, f"a divisor of mamba_expand x hidden_size = {inner} with mamba_d_head "
                       f"x mamba_n_heads = {inner} (mamba_d_head: {d.get('mamba_d_head')!r})")
        return _mamba2(d, inner, heads, head_dim, "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias",
                       "mamba_proj_bias", "hidden_act", "mamba_chunk_size", "time_step_limit")
    if reader == "lightning":  # the attention heads' sizes; block_size is the prefill's chunk
        heads = _int(d, "num_attention_heads", required=True)
        head_dim = _int(d, "head_dim") or hidden // heads
        return SSMConfig("lightning", heads * head_dim, head_dim, 1, conv_bias=False,
                         activation=_str(d, "hidden_act", "silu"), num_heads=heads, head_dim=head_dim,
                         chunk_size=_int(d, "block_size", 256))
    if reader == "lfm2":  # the gated short convolution: in / out projections with the conv's bias flag
        bias = _bool(d, "conv_bias", False)
        return SSMConfig("short_conv", hidden, 0, _int(d, "conv_L_cache", required=True), conv_bias=bias,
                         proj_bias=bias)
    if reader == "nemotron":  # (the hub's mamba_* names win, as NemotronHConfig pops them over the plain ones)
        def name(plain: str, hub: str) -> str:
            return hub if d.get(hub) is not None else plain

        heads, head_dim = _int(d, "mamba_num_heads", required=True), _int(d, "mamba_head_dim", required=True)
        low = _float(d, name("time_step_min", "mamba_dt_min"), 0.0)
        cfg = _mamba2(d, heads * head_dim, heads, head_dim, "ssm_state_size", name("n_groups", "mamba_n_groups"),
                      name("conv_kernel", "mamba_d_conv"), name("use_conv_bias", "mamba_conv_bias"), "use_bias",
                      "mamba_hidden_act", name("chunk_size", "mamba_chunk_size"), "")
        # the mixer clamps dt below at time_step_min, never above (time_step_limit is not read)
        return dataclasses.replace(cfg, time_step_limit=(low, math.inf))
    raise ValueError(f"unknown SSM reader {reader!r}")  # (a FAMILY_DEFAULTS entry names one of the above)


def _mamba2(d: dict, inner: int, heads: int, head_dim: int, state: str, groups: str, conv: str, conv_bias: str,
            proj_bias: str, act: str, chunk: str, limit: str) -> SSMConfig:
    """A Mamba-2 :class:`SSMConfig` from the config's fields of these names."""
    n_groups = _int(d, groups, 1)
    if heads % n_groups:
        raise _err(groups, n_groups, f"a divisor of the Mamba heads ({heads})")
    return SSMConfig("mamba2", inner, _int(d, state, required=True), _int(d, conv, required=True),
                     conv_bias=_bool(d, conv_bias, True), proj_bias=_bool(d, proj_bias, False),
                     activation=_str(d, act, "silu"), num_heads=heads, head_dim=head_dim, n_groups=n_groups,
                     chunk_size=_int(d, chunk, 256), time_step_limit=_time_step_limit(d, limit))


def _m3_flags(d: dict, name: str, layers: int, default: int = 0) -> list:
    """MiniMax-M3's per-layer 0/1 flags: ``sparse_attention_freq`` (in ``sparse_attention_config``) or
    ``moe_layer_freq`` (top level); absent: ``default`` for every layer."""
    v = (d.get("sparse_attention_config") or {}).get(name) if name == "sparse_attention_freq" else d.get(name)
    if v is None:
        return [default] * layers
    if not isinstance(v, (list, tuple)) or len(v) != layers or any(f not in (0, 1) for f in v):
        raise _err(name, v, f"a list of {layers} flags (0 / 1 or true / false), one per layer")
    return [bool(f) for f in v]


#: Nemotron-H's feed-forward-only blocks (its layer_types also name them; other families refuse them)
NEMOTRON_BLOCKS = ("moe", "mlp")
_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def _nemotron_blocks(d: dict) -> list:
    """Nemotron-H's block kinds as NemotronHConfig derives them: layer_types (legacy names remapped), else the hub's
    hybrid_override_pattern (one character per block: M Mamba, * attention, E MoE, - MLP), else its default."""
    v = d.get("layer_types")
    if v is None:
        pattern = d.get("hybrid_override_pattern")
        if pattern is None:
            return ["linear_attention", "moe", "full_attention", "mlp"]
        if not isinstance(pattern, str) or not pattern or any(c not in _NEMOTRON_PATTERN for c in pattern):
            raise _err("hybrid_override_pattern", pattern, f"a non-empty string of {sorted(_NEMOTRON_PATTERN)}")
        return [_NEMOTRON_PATTERN[c] for c in pattern]
    if not isinstance(v, (list, tuple)) or not v:
        raise _err("layer_types", v, f"a non-empty list of block kinds from {list(_NEMOTRON_PATTERN.values())}")
    return [_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in v]


#: the layer kinds' names before transformers 5 (config classes remap them, as here)
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def _jamba_layers(d: dict, layers: int, experts: int) -> tuple[tuple, tuple]:
    """Jamba's (layer_types, mlp_layer_types) as JambaConfig derives them: attention where i % attn_layer_period
    == attn_layer_offset (else Mamba: 'linear_attention'); MoE where i % expert_layer_period == expert_layer_offset
    (when there is more than one expert), else a dense MLP."""
    out = []
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        p, o = _int(d, period, required=True), _int(d, offset, minimum=0, required=True)
        if o >= p:
            raise _err(offset, o, f"an int < {period}={p}")
        out.append([i % p == o for i in range(layers)])
    attn, moe = out
    return (tuple("full_attention" if a else "linear_attention" for a in attn),
            tuple("sparse" if m and experts > 1 else "dense" for m in moe))


# ------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class ModelConfig:
    """What the model families read, typed and validated (see :meth:`from_dict`).

    Layer structure: ``layer_types[i]`` is 'full_attention', 'sliding_attention' (window
    ``sliding_window``), 'chunked_attention' (Llama-4: chunks of ``attention_chunk_size``) or
    'indexed_attention' (V3.2 / GLM-5 sparse attention, whose families build it whatever the entry says),
    'linear_attention' (a recurrent layer: Gated DeltaNet, KDA, Mamba, lightning attention, as the family says), or
    a kind of one family only (Nemotron-H's 'moe' / 'mlp' blocks, LFM2's 'conv', MiniMax-M3's 'minimax_m3_sparse');
    :meth:`is_moe_layer` says whether layer i has routed experts;
    ``indexer_types`` (GLM-5) which layers run their own indexer.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    #: Cohere2-MoE: the norms are LayerNorms (mean subtracted; weight, no bias) with eps ``rms_norm_eps`` (read from
    #: ``layer_norm_eps``), not RMSNorms
    layer_norm: bool = False
    architectures: tuple = ()
    #: ((layer type, RopeConfig), ...) where the RoPE differs per layer type (MiMo-V2-Flash; DeepSeek-V4: by the
    #: labels "main" and "compress"; ``rope`` is the
    #: full-attention one); () = ``rope`` for every layer
    rope_by_layer_type: tuple = ()
    intermediate_size: Optional[int] = None        # dense MLP layers
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    #: Qwen2-MoE: biases on q/k/v only (o_proj has none)
    qkv_bias: bool = False
    #: OLMoE: q, k and v are clamped to [-clip_qkv, clip_qkv] after their projections (and norms)
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: tuple = ()
    # routed experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    #: Qwen2-MoE, Qwen3-Next / Qwen3.5 (and GraniteMoE-Shared's ``shared_intermediate_size``): the hidden size of
    #: the one shared expert
    shared_expert_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = False
    mlp_only_layers: tuple = ()
    decoder_sparse_step: int = 1
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V3 / Kimi-K2 / GLM-4.5 (and V3.2 / GLM-5 indexer)
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: Optional[str] = None
    use_qk_norm: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    rope_interleave: bool = False
    index_topk: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_n_heads: Optional[int] = None
    #: GLM-5: per layer, 'full' (runs its indexer) or 'shared' (reuses the previous full layer's top-k); () = all full
    indexer_types: tuple = ()
    #: DeepSeek-V3.2 / GLM-5: per layer 'dense' or 'sparse' (overrides first_k_dense_replace when given)
    mlp_layer_types: tuple = ()
    num_nextn_predict_layers: int = 0
    #: Phi-3.5-MoE: SparseMixer's relative margin at inference (2 * router_jitter_noise), and a bias on the lm_head
    router_jitter_noise: float = 0.0
    lm_head_bias: bool = False
    #: LongCat-Flash: zero-computation experts (their output is their input) after the routed ones in the routing
    #: pool (``zero_expert_num``); a bias on the router's logits (``router_bias``)
    zero_experts: int = 0
    router_bias: bool = False
    # GraniteMoE (muP): embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, softmax scale attention_multiplier (None: head_dim^-1/2),
    # logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    # Qwen3-Next / Qwen3.5: Gated DeltaNet ('linear_attention' layers) and the sigmoid-gated shared expert
    linear_conv_kernel_dim: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_num_key_heads: Optional[int] = None
    linear_num_value_heads: Optional[int] = None
    # Llama-4: 'chunked_attention' layers see the keys of their own chunk of attention_chunk_size positions;
    # no_rope_layers[i] 1 = RoPE in layer i, 0 = NoPE (() = RoPE everywhere); on NoPE layers with
    # attn_temperature_tuning the queries are scaled by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale));
    # intermediate_size_mlp: the dense layers' MLP width (the experts' and shared expert's: intermediate_size)
    attention_chunk_size: Optional[int] = None
    no_rope_layers: tuple = ()
    attn_temperature_tuning: bool = False
    floor_scale: Optional[float] = None
    attn_scale: Optional[float] = None
    intermediate_size_mlp: Optional[int] = None
    #: the recurrent layers' sizes of Jamba, GraniteMoE-Hybrid, Nemotron-H (Mamba), MiniMax-Text-01 (lightning
    #: attention) and LFM2-MoE (short convolutions); None for the other families
    ssm: Optional[SSMConfig] = None
    #: the config.json nested this model under ``text_config`` (Qwen3.5-MoE's multimodal checkpoint)
    text_config_nested: bool = False
    # tokens
    bos_token_id: Optional[int] = None
    eos_token_id: tuple = ()
    pad_token_id: Optional[int] = None
    quantization_config: Optional[dict] = field(default=None, compare=False)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def family_type(self) -> str:
        """The model_type whose family defaults apply: a wrapper's text model type, else ``model_type``."""
        return self.raw.get("text_model_type") or self.model_type

    def layer_sliding_window(self, i: int) -> Optional[int]:
        """The sliding window of layer i, or None for full attention (DeepSeek-V4's compressed layers attend over a
        window of uncompressed keys too)."""
        return self.sliding_window if self.layer_types and self.layer_types[i] in _WINDOWED else None

    def layer_reference_window(self, i: int) -> Optional[int]:
        """The window of layer i's reference sliding-window attention (Unlimited-OCR's 'reference_sliding_attention':
        the prompt stays in sight, generated tokens slide over it), or None."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "reference_sliding_attention" else None

    def layer_attention_chunk(self, i: int) -> Optional[int]:
        """The attention chunk of layer i (Llama-4's 'chunked_attention' layers), or None."""
        return self.attention_chunk_size if self.layer_types and self.layer_types[i] == "chunked_attention" else None

    def layer_uses_rope(self, i: int) -> bool:
        """Whether layer i rotates its queries and keys (``no_rope_layers``; () = every layer)."""
        return not self.no_rope_layers or bool(self.no_rope_layers[i])

    def kv_elements_per_position(self) -> int:
        """Cache elements one position of one sequence takes over all layers: keys and values per KV head
        (GQA), or the compressed latent and the rotary key (MLA), plus the indexer's key (DSA)."""
        if self.model_type == "deepseek_v4":  # the key; a compressed layer's raw rows and entries (see deepseek_v4.py)
            d, i = self.head_dim, self.index_head_dim or 0
            per = {"sliding_attention": d, "heavily_compressed_attention": 4 * d,
                   "compressed_sparse_attention": 6 * d + 5 * i}
            return sum(per[t] for t in self.layer_types)
        if self.family_type in INKLING_TYPES:  # the sliding layers' own KV heads and head size (looped: once a pass)
            return sum(2 * kv * d for _, kv, d in inkling_cache_sizes(self))
        if self.family_type == "gemma4_text":  # own sizes; shared layers none
            return sum(2 * g.num_key_value_heads * g.head_dim for i, g in enumerate(gemma4_attention_layers(self))
                       if g.kv_source == i)
        if self.family_type == "qwen4_exp_text":  # indexed layers: keys, values, the QSA's raw and block keys
            per = 2 * self.num_key_value_heads * self.head_dim + 2 * (self.index_head_dim or 0)
            return per * sum(t == "indexed_attention" for t in self.layer_types)
        if self.kv_lora_rank:
            per_layer = self.kv_lora_rank + (self.qk_rope_head_dim or 0) + (self.index_head_dim or 0)
        elif self.model_type == "mimo_v2_flash":  # values v_head_dim wide; sliding layers have twice the KV heads
            return sum((2 if t == "sliding_attention" else 1) * self.num_key_value_heads * (self.head_dim + self.v_head_dim)
                       for t in self.layer_types)
        else:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        # linear-attention layers keep a fixed-size state per sequence instead (see linear_attention.py); Nemotron-H's
        # feed-forward blocks keep nothing
        linear = sum(t in ("linear_attention", "conv") + NEMOTRON_BLOCKS for t in self.layer_types)
        sublayers = 2 if self.model_type == "longcat_flash" else 1   # (two attention sublayers per layer)
        # MiniMax-M3's block-sparse layers also cache their indexer's key
        indexed = sum(t == "minimax_m3_sparse" for t in self.layer_types) * (self.index_head_dim or 0)
        return per_layer * sublayers * (self.num_hidden_layers - linear) + indexed

    def state_elements_per_sequence(self) -> dict[str, int]:
        """Fixed-size cache elements one sequence takes over all linear-attention (or Mamba) layers, whatever its
        length: ``conv_state`` (the conv window, in the cache's dtype) and ``recurrent_state`` (fp32);
        zeros for models without such layers."""
        if self.family_type in INKLING_TYPES:  # four short convolutions per layer: keys, values, both outputs
            W = _int(self.raw, "conv_kernel_size", 4) - 1
            return {"conv_state": sum((2 * kv * d + 2 * self.hidden_size) * W
                                      for _, kv, d in inkling_cache_sizes(self)), "recurrent_state": 0}
        linear = sum(t in ("linear_attention", "conv") for t in self.layer_types)
        if not linear:
            return {"conv_state": 0, "recurrent_state": 0}
        if self.ssm is not None:  # Mamba layers: the conv window of x (and B, C) and the SSM state
            return {"conv_state": linear * self.ssm.conv_channels * (self.ssm.conv_kernel - 1),
                    "recurrent_state": linear * self.ssm.state_elements}
        key, value = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads * self.linear_value_head_dim
        conv = linear * (2 * key + value) * (self.linear_conv_kernel_dim - 1)
        if self.family_type == "qwen4_exp_text":  # + each PLE layer's dilated conv window over the streams (and its
            # n - 1 context token ids, int64, not counted)
            f = qwen4_fields(self)
            conv += len(f.ple_layers) * f.hc_count * self.hidden_size * (f.ple_conv_kernel_size - 1) * f.ngram_size
        return {"conv_state": conv,
                "recurrent_state": linear * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim}

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule (mlp_only_layers, decoder_sparse_step), DeepSeek's first_k_dense_replace, or
        ``mlp_layer_types`` when the config lists them (DeepSeek-V3.2 / GLM-5)."""
        if self.num_experts == 0:
            return False
        if self.mlp_layer_types:
            # a multi-token-prediction layer (past the list, i >= num_hidden_layers) is sparse, as DeepSeek's are
            return i >= len(self.mlp_layer_types) or self.mlp_layer_types[i] == "sparse"
        if i in self.mlp_only_layers or i < self.first_k_dense_replace:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    # ---- parsing ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse an HF config.json dict; ValueError naming the field for bad or missing values. A
        vision-language wrapper (:data:`TEXT_WRAPPERS`) parses as its text model, see :func:`unwrap_text_config`."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict (config.json's contents), got {type(d).__name__}")
        d = unwrap_text_config(d)
        model_type = _str(d, "model_type", None)
        if not model_type:
            raise ValueError("config field 'model_type' is required but missing")
        reason = refusal(model_type)  # before any field: a wrapper or hybrid would fail on one for the wrong reason
        if reason is not None:
            raise ValueError(f"{model_type}: {reason} (model_type {model_type!r} is not supported)")
        text_nested = d.get("text_model_type") is not None
        fam = FAMILY_DEFAULTS.get(d.get("text_model_type") or model_type, {})
        nested = {}
        for sub, names in fam.get("nested", {}).items():  # DBRX's attn_config / ffn_config, read as top-level fields
            inner = d.get(sub) or {}
            if not isinstance(inner, dict):
                raise _err(sub, inner, "a dict")
            nested.update({ours: inner[theirs] for theirs, ours in names.items() if inner.get(theirs) is not None})
        # the file's own (non-null) fields win over its nested ones, which win over the family's defaults
        # (Kimi-Linear: the nested ones win, as its config class reads them); fields the family's transformers
        # class does not read ("ignored") are dropped from the file (the defaults stay)
        ignored = fam.get("ignored", ())
        own = {k: v for k, v in d.items() if k not in ignored}
        if fam.get("nested_overrides"):
            d = {**fam.get("fields", {}), **own, **nested}
        else:
            d = {**fam.get("fields", {}), **nested, **{k: v for k, v in own.items() if v is not None or k not in nested}}
        for name in fam.get("per_layer_lists", ()):  # one value for every layer, or ValueError
            v = d.get(name)
            if isinstance(v, (list, tuple)):
                if not v or any(x != v[0] for x in v):
                    raise _err(name, v, "an int (or a list of one value for every layer: per-layer values are not supported)")
                d[name] = v[0]
        for ours, theirs in fam.get("aliases", {}).items():
            if d.get(ours) is None and d.get(theirs) is not None:
                d[ours] = d[theirs]
        names = fam.get("layer_type_names")
        if names:  # a family's own layer kind names (ZAYA's 'hybrid' / 'hybrid_sliding') -> ours, also as RoPE keys
            lt = d.get("layer_types")
            if lt is not None:
                if not isinstance(lt, (list, tuple)) or any(not isinstance(t, str) or t not in names for t in lt):
                    raise _err("layer_types", lt, f"a list of entries from {list(names)}")
                d["layer_types"] = [names[t] for t in lt]
            rp = d.get("rope_parameters")
            if isinstance(rp, dict) and rp and all(k in names for k in rp):
                d["rope_parameters"] = {names[k]: v for k, v in rp.items()}
        for ours, theirs in fam.get("overrides", {}).items():  # the hub's name wins whenever given (LFM2's tie_embedding)
            if d.get(theirs) is not None:
                d[ours] = d[theirs]
        scaling = d.get("rope_scaling")
        if (fam.get("deepseek_yarn") and isinstance(scaling, dict)
                and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type"))):  # Sarvam: YaRN by another name
            d = {**d, "rope_parameters": {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}}
            del d["rope_scaling"]
        if fam.get("ernie_vl"):  # [text, vision] expert widths: the text group's is the experts' (dynamoe runs text)
            sizes = d.get("moe_intermediate_size")
            if (not isinstance(sizes, (list, tuple)) or len(sizes) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes)):
                raise _err("moe_intermediate_size", sizes, "a list of two ints >= 1 (the text and the vision experts' "
                           "widths)")
            d = {**d, "moe_intermediate_size": sizes[0], "vision_moe_intermediate_size": sizes[1]}
        if fam.get("inkling_layers") and d.get("dense_intermediate_size") is not None:
            # (InklingTextConfig: the experts are intermediate_size wide, the dense MLPs dense_intermediate_size)
            d = {**d, "moe_intermediate_size": d.get("intermediate_size"), "intermediate_size": d["dense_intermediate_size"]}
        if fam.get("window_size_plus_one") and d.get("sliding_window_size") is not None:
            d["sliding_window"] = _int(d, "sliding_window_size") + 1
        if d.get("routed_scaling_factor", 0) is None:
            d["routed_scaling_factor"] = 1.0  # (MiMo-V2-Flash's hub config says null: no scaling)
        archs = d.get("architectures") or ()
        if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
            raise _err("architectures", archs, "a list of strings")

        if fam.get("heads_kv_times_top_k"):  # JetMoE: K heads per chosen attention expert
            d["num_attention_heads"] = (_int(d, "num_key_value_heads", required=True)
                                        * _int(d, "num_experts_per_tok", fam["num_experts_per_tok"], required=True))
        hidden = _int(d, "hidden_size", required=True)
        heads = _int(d, "num_attention_heads", required=True)
        if fam.get("num_layers_halved"):  # LongCat: our layers are its num_layers (two sublayers each; default: the value)
            given = d.get("num_hidden_layers")   # (LongcatFlashConfig sets it after num_layers: it wins)
            if given is not None:
                n = _int(d, "num_hidden_layers")
                if n % 2:
                    raise _err("num_hidden_layers", given, "an even int (twice num_layers: two sublayers per layer)")
                d["num_layers"] = n // 2
            d["num_hidden_layers"] = _int(d, "num_layers", fam["num_layers_halved"])
        if fam.get("nemotron_layers"):  # the block list decides the layer count (num_hidden_layers is derived)
            d = {**d, "layer_types": _nemotron_blocks(d)}
            d["num_hidden_layers"] = len(d["layer_types"])
        layers = _int(d, "num_hidden_layers", required=True)
        if fam.get("step_layers"):
            d = _step_trim_mtp(d, layers)
        elif fam.get("dots3_layers"):
            d = _step_trim_mtp(d, layers, _DOTS3_PER_LAYER_LISTS)
        kv_heads = _int(d, "num_key_value_heads", heads) or heads  # null: as many as the query heads
        if heads % kv_heads:
            raise _err("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}")
        if fam.get("bailing_sizes"):  # KDA heads: head_dim wide, num_attention_heads of them; MLA's RoPE: qk_rope
            kda_dim = _int(d, "head_dim", required=True)
            d = {**d, "linear_key_head_dim": kda_dim, "linear_value_head_dim": kda_dim, "linear_num_key_heads": heads,
                 "linear_num_value_heads": heads, "linear_conv_kernel_dim": _int(d, "short_conv_kernel_size", 4),
                 "head_dim": _int(d, "qk_rope_head_dim", required=True)}
        if fam.get("head_dim_is_qk"):  # Mistral-4's config class sets head_dim = qk_nope + qk_rope, whatever the file says
            head_dim = _int(d, "qk_nope_head_dim", required=True) + _int(d, "qk_rope_head_dim", required=True)
        elif fam.get("head_dim_is_rope") and d.get("head_dim") is None and d.get("qk_rope_head_dim") is not None:
            head_dim = _int(d, "qk_rope_head_dim")  # MLA: what transformers sets (and saves) when the file has none
        else:
            head_dim = _int(d, "head_dim", fam.get("head_dim")) or hidden // heads
        max_pos = _int(d, "max_position_embeddings", 4096)

        experts = fam.get("num_experts", 0)
        for key in _EXPERT_COUNT_KEYS:
            if d.get(key) is not None:
                experts = _int(d, key, minimum=0)
                break
        # GPT-OSS's config.json also says experts_per_token
        top_k = _int(d, "num_experts_per_tok", d.get("experts_per_token", fam.get("num_experts_per_tok", 0)), minimum=0)
        top_k = top_k or 0
        if experts and not 1 <= top_k <= experts:
            raise _err("num_experts_per_tok", top_k, f"an int in [1, num_experts={experts}]")

        sliding = _int(d, "sliding_window", fam.get("sliding_window"), minimum=0) or None  # 0: none (Qwen2-MoE)
        layer_types = d.get("layer_types")
        kinds = LAYER_TYPES + (("chunked_attention",) if fam.get("chunked_layers") else ()) + (
            NEMOTRON_BLOCKS if fam.get("nemotron_layers") else ()) + (("conv",) if fam.get("lfm2_layers") else ()) + (
            ("minimax_m3_sparse",) if fam.get("m3_layers") else ())
        if fam.get("reference_sliding_layers"):  # (its model builds no other kinds)
            kinds = ("full_attention", "reference_sliding_attention")
        chunk = _int(d, "attention_chunk_size") if fam.get("chunked_layers") else None
        no_rope_layers = _llama4_rope_layers(d, layers) if fam.get("llama4_layers") or fam.get("nope_layers") else ()
        if fam.get("rope_switch"):  # GraniteMoE-Hybrid: RoPE in every attention layer when the field says 'rope'
            switch = d.get(fam["rope_switch"])
            if switch not in (None, "rope"):
                raise _err(fam["rope_switch"], switch, "'rope' or null (no position encoding)")
            no_rope_layers = (int(switch == "rope"),) * layers
        if fam.get("ssm") and isinstance(layer_types, (list, tuple)):   # (the Mamba families' hub configs)
            layer_types = [_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in layer_types]
        if fam.get("v4_layers"):
            layer_types = _v4_layer_types(d, layers)
        elif fam.get("dots3_layers"):
            layer_types = _dots3_layer_types(d, layers)
        elif fam.get("glm5_layers"):  # every 4th layer (from 3) MLA, the others KDA
            every = 4 if layer_types is None else None
            layer_types = _linear_and_indexed(d, layer_types, layers, every)
        elif fam.get("qwen4_layers"):  # every n-th layer QSA-indexed attention, the others linear
            every = None if layer_types is not None else _int(d, "full_attention_interval", fam["full_attention_interval"])
            layer_types = _linear_and_indexed(d, layer_types, layers, every)
        elif layer_types is not None:
            if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != layers
                    or any(t not in kinds for t in layer_types)):
                raise _err("layer_types", layer_types, f"a list of {layers} entries from {list(kinds)}")
            layer_types = tuple(layer_types)
        elif fam.get("reference_sliding_layers"):
            layer_types = ("reference_sliding_attention",) * layers
        elif fam.get("llama4_layers"):  # the RoPE layers chunked (when there is a chunk size), the NoPE ones full
            layer_types = tuple("chunked_attention" if r and chunk is not None else "full_attention"
                                for r in no_rope_layers)
        elif fam.get("cohere_layers"):  # the dense prefix by its own pattern, the others every n-th full
            k = _int(d, "first_k_dense_replace", 0, minimum=0)
            if k > layers:
                raise _err("first_k_dense_replace", k, f"an int in [0, num_hidden_layers={layers}]")
            p, n = _int(d, "prefix_dense_sliding_window_pattern", required=True), _int(d, "sliding_window_pattern",
                                                                                       required=True)
            layer_types = tuple("sliding_attention" if (i + 1) % p else "full_attention" for i in range(k)) + tuple(
                "sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers - k))
        elif fam.get("full_attention_every"):  # every n-th layer full attention, the others sliding (Kolibri-1)
            n = fam["full_attention_every"]
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("inkling_layers"):  # sliding on local_layer_ids, else on all but every 6th
            local = d.get("local_layer_ids")
            if local is not None and (not isinstance(local, (list, tuple))
                                      or any(isinstance(i, bool) or not isinstance(i, int) for i in local)):
                raise _err("local_layer_ids", local, "a list of layer indices (the sliding-window layers)")
            local = set(local) if local is not None else {i for i in range(layers) if (i + 1) % 6}
            layer_types = tuple("sliding_attention" if i in local else "full_attention" for i in range(layers))
        elif fam.get("muse_layers"):  # every 4th layer counted back from the last full attention, the others sliding
            layer_types = tuple("full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("lara_layers"):  # the released pattern, period 5
            pattern = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")
            layer_types = tuple(pattern[i % 5] for i in range(layers))
        elif fam.get("gemma4_layers"):  # every 6th layer full attention, the others sliding (the last: below)
            layer_types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("beam_layers"):  # every 6th layer and the last full attention, the others sliding
            layer_types = tuple("full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("jamba_layers"):
            layer_types = _jamba_layers(d, layers, experts)[0]
        elif fam.get("m3_layers"):  # MiniMax-M3: the hub's per-layer sparse flags, else every layer full attention
            layer_types = tuple("minimax_m3_sparse" if f else "full_attention"
                                for f in _m3_flags(d, "sparse_attention_freq", layers))
        elif fam.get("bailing_layers"):  # the last layer of every group MLA, the others KDA
            n = _int(d, "layer_group_size", required=True)
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers))
        elif fam.get("minimax_layers"):  # MiniMax: even layers softmax attention, odd ones lightning
            layer_types = tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers))
        elif fam.get("mamba_layers_default"):   # GraniteMoE-Hybrid: every layer Mamba
            layer_types = ("linear_attention",) * layers
        elif fam.get("lfm2_layers"):  # LFM2: full attention on full_attn_idxs, short convolutions elsewhere
            idxs = d.get("full_attn_idxs")
            if idxs is None:
                raise ValueError(f"config field 'layer_types' (or 'full_attn_idxs') is required for {model_type}: "
                                 "which layers are attention and which short convolutions")
            if (not isinstance(idxs, (list, tuple))
                    or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in idxs)):
                raise _err("full_attn_idxs", idxs, f"a list of layer indices in [0, {layers})")
            layer_types = tuple("full_attention" if i in idxs else "conv" for i in range(layers))
        elif fam.get("afmoe_layers"):  # every n-th layer full attention, the others sliding
            n = _int(d, "global_attn_every_n_layers", required=True)
            layer_types = tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers))
        elif fam.get("step_layers") or fam.get("full_layers_by_default"):  # every layer full, whatever the window
            layer_types = ("full_attention",) * layers
        elif fam.get("granite_swa_layers"):
            layer_types = tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers))
        elif fam.get("flint_layers"):
            layer_types = tuple("full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("mimo_layers"):  # layer 0 and every 6th full attention, the others sliding
            layer_types = tuple("full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(layers))
        elif fam.get("kimi_layers"):
            layer_types = _kimi_layer_types(d.get("linear_attn_config") or {}, layers)
        elif fam.get("full_attention_interval"):  # Qwen3-Next / Qwen3.5: every n-th layer full, the others linear
            n = _int(d, "full_attention_interval", fam["full_attention_interval"])
            layer_types = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers))
        elif fam.get("alternating_layers"):  # GPT-OSS: even layers sliding, odd layers full
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        elif fam.get("exaone_windows"):  # every pattern-th layer global (transformers derives no other pattern)
            pattern = d.get("sliding_window_pattern")
            if sliding is None or isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ValueError(f"config field 'layer_types' is required for {model_type} unless sliding_window is set "
                                 f"and sliding_window_pattern is an int >= 1 (got {sliding!r}, {pattern!r})")
            layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
        elif fam.get("windows_from_max_window_layers"):  # dots1: layers >= max_window_layers slide (when windowed)
            start = _int(d, "max_window_layers", minimum=0)
            layer_types = tuple("sliding_attention" if sliding is not None and i >= start else "full_attention"
                                for i in range(layers))
            sliding = sliding if "sliding_attention" in layer_types else None
        elif fam.get("qwen2_windows") and _bool(d, "use_sliding_window", False):  # even layers < max_window_layers
            below = _int(d, "max_window_layers", minimum=0)
            layer_types = tuple("sliding_attention" if i % 2 == 0 and i < below else "full_attention"
                                for i in range(layers))
        elif sliding is not None and _bool(d, "use_sliding_window", True):
            layer_types = ("sliding_attention",) * layers  # Mixtral / Qwen3 with use_sliding_window
        else:
            layer_types = ("full_attention",) * layers
            sliding = None  # as Qwen3MoeConfig: no window unless use_sliding_window
        if fam.get("muse_layers"):  # layer_rope_theta: 0 = NoPE (its other values are not read: one RoPE base)
            thetas = d.get("layer_rope_theta")
            if thetas is None:
                no_rope_layers = tuple(int((layers - 1 - i) % 4 != 0) for i in range(layers))
            elif (not isinstance(thetas, (list, tuple)) or len(thetas) != layers
                  or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in thetas)):
                raise _err("layer_rope_theta", thetas, f"a list of {layers} numbers >= 0 (0: no RoPE in that layer)")
            else:
                no_rope_layers = tuple(int(bool(t)) for t in thetas)
        if fam.get("gemma4_layers") and layer_types and layer_types[-1] != "full_attention":
            # (Gemma4TextConfig forces the last layer to full attention, with a warning)
            log.warning("config field 'layer_types': the last layer must be 'full_attention', got %r; forcing it as "
                        "transformers does", layer_types[-1])
            layer_types = tuple(layer_types[:-1]) + ("full_attention",)
        if "sliding_attention" in layer_types and sliding is None:
            raise ValueError("config field 'sliding_window' is required when layer_types has 'sliding_attention'")
        if "reference_sliding_attention" in layer_types and sliding is None:
            raise ValueError("config field 'sliding_window' is required (an int >= 1) when layer_types has "
                             f"'reference_sliding_attention', got {d.get('sliding_window')!r}")
        if "chunked_attention" in layer_types and chunk is None:
            raise ValueError("config field 'attention_chunk_size' is required when layer_types has 'chunked_attention'")
        linear_sizes = {name: _int(d, name) for name in _LINEAR_ATTENTION_FIELDS}
        ssm = _parse_ssm(d, fam["ssm"], hidden) if fam.get("ssm") else None
        if "linear_attention" in layer_types and ssm is None:
            for name, v in linear_sizes.items():
                if v is None:
                    raise ValueError(f"config field {name!r} is required when layer_types has 'linear_attention'")
            if linear_sizes["linear_num_value_heads"] % linear_sizes["linear_num_key_heads"]:
                raise _err("linear_num_value_heads", linear_sizes["linear_num_value_heads"],
                           f"a multiple of linear_num_key_heads={linear_sizes['linear_num_key_heads']}")

        # (DeepSeek-V4: every layer MoE; its 'hash_moe' / 'moe' kinds are read by dynamoe.models.deepseek_v4)
        mlp_types = () if fam.get("v4_layers") else _str_list(d, "mlp_layer_types", layers, MLP_LAYER_TYPES)
        if not mlp_types and fam.get("step_layers"):
            mlp_types = _step_mlp_types(d, layers)
        if not mlp_types and fam.get("moe_switch"):  # one switch for every layer (Doge's is_moe)
            mlp_types = ("sparse" if _bool(d, fam["moe_switch"], False) else "dense",) * layers
        if not mlp_types and fam.get("inkling_layers"):  # the hub's first dense_mlp_idx layers dense
            n = min(_int(d, "dense_mlp_idx", 0, minimum=0), layers)
            mlp_types = ("dense",) * n + ("sparse",) * (layers - n)
        if not mlp_types and fam.get("dense_prefix"):  # the first n layers dense (Beam: 3)
            n = min(fam["dense_prefix"], layers)
            mlp_types = ("dense",) * n + ("sparse",) * (layers - n)
        if not mlp_types and fam.get("m3_layers"):  # the hub's moe_layer_freq, else every layer MoE
            mlp_types = tuple("sparse" if f else "dense" for f in _m3_flags(d, "moe_layer_freq", layers, default=1))
        if not mlp_types and fam.get("nemotron_layers"):  # the 'moe' blocks
            mlp_types = tuple("sparse" if t == "moe" else "dense" for t in layer_types)
        if not mlp_types and fam.get("jamba_layers"):
            mlp_types = _jamba_layers(d, layers, experts)[1]
        if not mlp_types and fam.get("axk_mlp_layers"):  # A.X-K1/K2, dots3: MoE from first_k_dense_replace, every freq-th
            first, freq = _int(d, "first_k_dense_replace", minimum=0), d.get("moe_layer_freq")
            if isinstance(freq, (list, tuple)):  # (dots3: one flag per layer)
                if len(freq) < layers:
                    raise _err("moe_layer_freq", freq, f"an int >= 1 or a list of {layers} flags")
                mlp_types = tuple("sparse" if i >= first and bool(freq[i]) else "dense" for i in range(layers))
            else:
                freq = _int(d, "moe_layer_freq")
                mlp_types = tuple("sparse" if i >= first and i % freq == 0 else "dense" for i in range(layers))
        if not mlp_types and fam.get("glm5_layers"):  # the first three dense
            mlp_types = ("dense",) * min(3, layers) + ("sparse",) * max(0, layers - 3)
        if not mlp_types and fam.get("first_k_dense") is not None:  # the first first_k_dense_replace layers dense
            k = min(_int(d, "first_k_dense_replace", fam["first_k_dense"], minimum=0), layers)
            mlp_types = ("dense",) * k + ("sparse",) * (layers - k)
        if not mlp_types and fam.get("first_layer_dense"):
            mlp_types = ("dense",) + ("sparse",) * (layers - 1)
        if not mlp_types and fam.get("llama4_layers"):  # moe_layers, else every step-th layer from step - 1
            moe_ids = d.get("moe_layers")
            if moe_ids is None:
                step = _int(d, "interleave_moe_layer_step")
                moe_ids = range(step - 1, layers, step)
            elif (not isinstance(moe_ids, (list, tuple))
                  or any(isinstance(i, bool) or not isinstance(i, int) for i in moe_ids)):
                raise _err("moe_layers", moe_ids, "a list of layer indices")
            mlp_types = tuple("sparse" if i in set(moe_ids) else "dense" for i in range(layers))
        if not mlp_types and fam.get("ernie_moe_layers"):
            start, every = _int(d, "moe_layer_start_index", minimum=0), _int(d, "moe_layer_interval")
            end = _int(d, "moe_layer_end_index", minimum=-1)
            end = layers - 1 if end == -1 else end
            mlp_types = tuple("sparse" if (i + 1) % every == 0 and start <= i <= end else "dense" for i in range(layers))
        if fam.get("cohere_layers"):  # the first first_k_dense_replace layers dense; RoPE on the sliding layers and,
            # with a prefix pattern of 1 (all full), on the dense ones
            if not mlp_types:
                k = _int(d, "first_k_dense_replace", 0, minimum=0)
                mlp_types = tuple("dense" if i < k else "sparse" for i in range(layers))
            prefix_rope = _int(d, "prefix_dense_sliding_window_pattern", required=True) == 1
            no_rope_layers = tuple(int(t == "sliding_attention" or (m == "dense" and prefix_rope))
                                   for t, m in zip(layer_types, mlp_types))
        if fam.get("hy_indexers"):  # Hy4: indexer_types, else full on layer 0 and every 4th from 1 (no other rule)
            indexer_types = (_str_list(d, "indexer_types", layers, INDEXER_TYPES)
                             or tuple("full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)))
        else:
            indexer_types = _indexer_types(d, layers)
        mlp_only = _int_list(d, "mlp_only_layers")
        if any(not 0 <= i < layers for i in mlp_only):
            raise _err("mlp_only_layers", list(mlp_only), f"layer indices in [0, {layers})")
        eos = _int_list(d, "eos_token_id")
        quant = d.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise _err("quantization_config", quant, "a dict")
        scoring = _str(d, "scoring_func", "softmax")
        scorings = fam.get("scoring_funcs", ("softmax", "sigmoid"))
        if scoring not in scorings:
            raise _err("scoring_func", scoring, " or ".join(repr(f) for f in scorings))
        n_group = _int(d, "n_group", 1) or 1  # null (DeepSeek-V2's greedy routing): one group
        topk_group = _int(d, "topk_group", 1) or 1
        if topk_group > n_group:
            raise _err("topk_group", topk_group, f"<= n_group={n_group}")

        if fam.get("v4_layers"):
            layer_ropes = _v4_ropes(d, max_pos, head_dim)
            rope = layer_ropes[0][1]
        elif fam.get("dots3_layers"):
            layer_ropes = _dots3_ropes(d, max_pos, layer_types)
            rope = layer_ropes[0][1]
        elif fam.get("rope_by_layer_type") or fam.get("step_layers"):
            layer_ropes = (_step_ropes(d, max_pos, layer_types) if fam.get("step_layers") else
                           _ropes_by_layer_type(d, max_pos, fam["rope_by_layer_type"], layer_types,
                                                fam.get("rope_partial_default"), bool(fam.get("nope_kinds"))))
            if not layer_ropes:
                raise _err("rope_parameters", d.get("rope_parameters"), "RoPE parameters for at least one layer type")
            rope = dict(layer_ropes).get("full_attention", layer_ropes[0][1])
            if fam.get("nope_kinds"):  # the layers of a kind without RoPE parameters are NoPE
                kinds = dict(layer_ropes)
                no_rope_layers = tuple(int(t in kinds) for t in layer_types)
        else:
            layer_ropes = ()
            partial = fam.get("partial_rotary_factor", 1.0)
            if fam.get("rotary_dim"):
                partial = _rotary_dim_factor(d, head_dim)
            elif fam.get("partial_is_rope_share"):
                partial = _int(d, "qk_rope_head_dim") / head_dim
            rope = parse_rope(d, max_pos, fam.get("rope_theta", 10000.0), fam.get("rope"), partial)

        layer_norm = bool(fam.get("layer_norm_unless_rms")) and d.get("rms_norm_eps") is None
        if layer_norm and d.get("layer_norm_eps") is None:
            raise ValueError("config field 'layer_norm_eps' is required (a number > 0) when 'rms_norm_eps' is null")
        cfg = cls(
            model_type=model_type, architectures=tuple(archs),
            vocab_size=_int(d, "vocab_size", required=True), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_pos,
            rms_norm_eps=(_float(d, "layer_norm_eps", positive=True) if layer_norm
                          else _float(d, "rms_norm_eps", 1e-6, positive=True)), layer_norm=layer_norm,
            rope=rope, rope_by_layer_type=layer_ropes,
            intermediate_size=_int(d, "intermediate_size"), hidden_act=_str(d, "hidden_act", "silu"),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=_bool(d, "attention_bias", fam.get("attention_bias", False)),
            qkv_bias=_bool(d, "qkv_bias", False), clip_qkv=_float(d, "clip_qkv", positive=True),
            sliding_window=sliding, layer_types=layer_types,
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=_int(d, "moe_intermediate_size"),
            shared_expert_intermediate_size=_int(d, "shared_expert_intermediate_size",
                                                 d.get("shared_intermediate_size"), minimum=0) or None,
            router_jitter_noise=_float(d, "router_jitter_noise", 0.0), lm_head_bias=_bool(d, "lm_head_bias", False),
            zero_experts=_int(d, "zero_expert_num", 0, minimum=0) or 0, router_bias=_bool(d, "router_bias", False),
            embedding_multiplier=_float(d, "embedding_multiplier", 1.0, positive=True),
            residual_multiplier=_float(d, "residual_multiplier", 1.0, positive=True),
            attention_multiplier=_float(d, "attention_multiplier", positive=True),
            logits_scaling=_float(d, "logits_scaling", 1.0, positive=True),
            norm_topk_prob=_bool(d, "norm_topk_prob", False), mlp_only_layers=mlp_only,
            decoder_sparse_step=_int(d, "decoder_sparse_step", 1),
            swiglu_limit=_float(d, "swiglu_limit", positive=True),
            swiglu_alpha=_float(d, "swiglu_alpha", 1.702, positive=True),
            first_k_dense_replace=_int(d, "first_k_dense_replace", 0, minimum=0),
            n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0, positive=True),
            n_shared_experts=_int(d, "n_shared_experts", 0, minimum=0), scoring_func=scoring,
            topk_method=_str(d, "topk_method", None), use_qk_norm=_bool(d, "use_qk_norm", False),
            q_lora_rank=_int(d, "q_lora_rank"), kv_lora_rank=_int(d, "kv_lora_rank"),
            qk_nope_head_dim=_int(d, "qk_nope_head_dim"), qk_rope_head_dim=_int(d, "qk_rope_head_dim", minimum=0),
            v_head_dim=_int(d, "v_head_dim"), rope_interleave=_bool(d, "rope_interleave", fam.get("rope_interleave", False)),
            index_topk=_int(d, "index_topk"), index_head_dim=_int(d, "index_head_dim"),
            index_n_heads=_int(d, "index_n_heads"), indexer_types=indexer_types, mlp_layer_types=mlp_types,
            num_nextn_predict_layers=_int(d, "num_nextn_predict_layers", 0, minimum=0),
            **linear_sizes,
            attention_chunk_size=chunk, no_rope_layers=no_rope_layers,
            attn_temperature_tuning=_bool(d, "attn_temperature_tuning", False),
            floor_scale=_float(d, "floor_scale", positive=True), attn_scale=_float(d, "attn_scale"),
            intermediate_size_mlp=_int(d, "intermediate_size_mlp"),
            ssm=ssm, text_config_nested=text_nested,
            bos_token_id=_int(d, "bos_token_id", minimum=0), eos_token_id=eos,
            pad_token_id=_int(d, "pad_token_id", minimum=0), quantization_config=quant, raw=dict(d),
        )
        if fam.get("gemma4_layers"):
            bidir = d.get("use_bidirectional_attention")
            if bidir not in (None, "vision"):  # ('vision': image tokens see each other; text stays causal)
                raise _err("use_bidirectional_attention", bidir, "null or 'vision' (dynamoe runs causal language "
                           "models; 'all' makes every layer bidirectional)")
            if _bool(d, "enable_moe_block", False) and not (cfg.num_experts and cfg.num_experts_per_tok
                                                            and cfg.moe_intermediate_size):
                raise ValueError("config fields 'num_experts', 'top_k_experts' and 'moe_intermediate_size' are required "
                                 "when 'enable_moe_block' is true")
            gemma4_attention_layers(cfg)   # (its errors now, not when the model is built)
        if cfg.num_experts and cfg.moe_intermediate_size is None and cfg.intermediate_size is None:
            raise ValueError("config field 'moe_intermediate_size' (or 'intermediate_size') is required for an MoE model")
        return cfg

    @property
    def expert_hidden_size(self) -> int:
        """F of the routed experts: ``moe_intermediate_size`` (Qwen3, DeepSeek, GLM) or ``intermediate_size``
        (Mixtral, GPT-OSS, which have no dense layers)."""
        return self.moe_intermediate_size or self.intermediate_size


def unwrap_text_config(d: dict) -> dict:
    """A multimodal wrapper's config.json (outer ``model_type`` in :data:`TEXT_WRAPPERS`, e.g. Kimi-K2.5's
    ``kimi_k25`` around a DeepSeek-V3 text model) as one flat dict of its text model, the one path every
    wrapper takes: the text config's fields; ``architectures`` and token ids from the outermost level that
    gives them; ``tie_word_embeddings`` from the level right above the text config (else the wrapper's
    default; or the text config's own flag alone where the wrapper says ``tie_by_text``: :class:`TextWrapper`); ``quantization_config`` from whichever level has it (ValueError if two
    differ); ``model_type`` the outer one and ``text_model_type`` the inner one (whose family defaults
    apply); ``text_eos_token_id`` the text config's own eos (what a text model's layers read, Qwen4-Exp's n-gram
    embeddings); ``vision_config`` kept for reference. Any other dict comes back as it is."""
    outer_type = d.get("model_type")
    spec = TEXT_WRAPPERS.get(outer_type)
    if spec is None:
        return d
    if spec.legacy_key and d.get(spec.path[0]) is None:
        legacy = d.get(spec.legacy_key)
        legacy = {} if legacy is None else legacy
        if not isinstance(legacy, dict):
            raise _err(spec.legacy_key, legacy, f"a dict (the text model's config, which a {outer_type!r} config nests)")
        moved = {k: d[k] for k in spec.legacy_fields if k in d}
        d = {k: v for k, v in d.items() if k not in spec.legacy_fields and k != spec.legacy_key}
        d[spec.path[0]] = {**legacy, **moved, "model_type": spec.text_types[0]}
    levels, where = [d], []
    for key in spec.path:
        where.append(key)
        sub = levels[-1].get(key)
        if not isinstance(sub, dict):
            raise _err(".".join(where), sub, f"a dict (the text model's config, which a {outer_type!r} config nests)")
        levels.append(sub)
    text, parent, name = levels[-1], levels[-2], ".".join(where)
    inner_type = text.get("model_type", spec.text_types[0])
    if inner_type not in spec.text_types:
        raise _err(f"{name}.model_type", inner_type, f"one of {list(spec.text_types)} (a {outer_type!r} "
                   f"checkpoint's text model)")
    flat = dict(text)
    flat["text_eos_token_id"] = text.get("eos_token_id")
    for key in _WRAPPER_FIELDS:
        given = [level[key] for level in levels[:-1] if level.get(key) is not None]
        if given:
            flat[key] = given[0]
    tie = parent.get("tie_word_embeddings")
    tie = spec.tie_default if tie is None else tie
    flat["tie_word_embeddings"] = tie or (spec.tie_from_text and text.get("tie_word_embeddings") is True)
    if spec.tie_by_text:
        flat["tie_word_embeddings"] = text.get("tie_word_embeddings") is True
    quant = {}
    for level, at in zip(levels, ["", *(".".join(where[:i + 1]) + "." for i in range(len(where)))]):
        if level.get("quantization_config") is not None:
            quant[at + "quantization_config"] = level["quantization_config"]
    found = list(quant.values())
    if any(q != found[0] for q in found[1:]):
        raise ValueError(f"config fields {sorted(quant)} are all given and differ: which one describes the tensors "
                         "is ambiguous")
    if quant:
        flat["quantization_config"] = next(iter(quant.values()))
    flat["model_type"], flat["text_model_type"] = outer_type, inner_type
    if "vision_config" in d:
        flat["vision_config"] = d["vision_config"]
    return flat
