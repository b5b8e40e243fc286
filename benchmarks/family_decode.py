"""Decode speed of every registered family at one small-but-not-tiny size, next to Qwen3-MoE's (the fused reference),
and which of its layers run fused (the DecodePlan's summary).

    python benchmarks/family_decode.py [--families qwen3_moe laguna ...] [--steps 32] [--prefill 64] [--dtype bfloat16]

Each family is built from its transformers configuration class (the text config of a multimodal wrapper, wherever
the wrapper nests it: Qwen3-Omni's thinker_config.text_config) with the sizes of ``SIZES`` -- hidden 512, 4 layers,
8 heads / 2 KV heads of 64, 8 experts top-2 of 512, vocab 4096 -- under whichever of their names the configuration
class takes (``FAMILY_OVERRIDES`` for what a family needs besides: sizes its class ties together, a layer order it has
no default for; a name only the wrapper takes, such as ``vision_config``, goes to the wrapper). The model class is
the causal-LM or image-text auto class's (a wrapper: the image-text one first), else the class of the configuration's
own modeling module (a wrapper's text config: its base model, saved under a causal LM's names). It is built on the
meta device and only its text model and lm_head are made, with random weights, and saved as safetensors -- under
the names and tensor layout ``save_pretrained`` writes (transformers' weight conversions reversed) -- to a temporary
folder, then loaded by ``dynamoe.models.load`` in ``--dtype``; a wrapper's vision / audio towers are left out
(dynamoe does not load them). Batch 1: a
``--prefill``-token prompt, then ``--steps`` decode steps of one token; ms/token is their median (after two warm-up
steps). "fused" is the DecodePlan's "x of N layers fused" (no plan: the model decodes through its own forward).
"ratio" is ms/token over qwen3_moe's, the reference model's decode steps interleaved with the family's (one step
each in turn, each on its own cache), so that both see the same load on a shared machine. A family whose configuration cannot be built at these
sizes is listed with the error instead of a time.
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dynamoe.models  # noqa: E402
from dynamoe.models.registry import supported_families  # noqa: E402

D, F_MOE, F_DENSE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, VOCAB = 512, 512, 1024, 4, 8, 2, 64, 8, 2, 4096
# one value under every name the families' configuration classes use for it (each class gets the names it takes)
SIZES = dict(
    vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM, intermediate_size=F_DENSE, moe_intermediate_size=F_MOE, expert_intermediate_size=F_MOE,
    shared_expert_intermediate_size=F_MOE, share_expert_dim=F_MOE, num_experts=EXPERTS, num_local_experts=EXPERTS,
    n_routed_experts=EXPERTS, moe_num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_k=TOP_K, moe_topk=TOP_K,
    top_k_experts=TOP_K,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=4096, tie_word_embeddings=False,
    kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_shared_experts=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# what a family needs besides (or instead of) SIZES at this size
FAMILY_OVERRIDES: dict[str, dict] = {
    "dbrx": dict(d_model=D, n_layers=LAYERS, n_heads=HEADS, max_seq_len=4096,
                 attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=10000.0), ffn_config=dict(ffn_hidden_size=F_MOE, moe_num_experts=EXPERTS,
                                                                        moe_top_k=TOP_K)),
    "jetmoe": dict(kv_channels=HEAD_DIM, num_key_value_heads=HEADS // 2),
    # (its RoPE spans head_dim, applied to the qk_rope_head_dim part of each head: transformers needs them equal)
    "longcat_flash": dict(num_layers=LAYERS, ffn_hidden_size=F_DENSE, expert_ffn_hidden_size=F_MOE, head_dim=32),
    # (MLA: as many KV heads as query heads; the vision adapter's output is the text model's input)
    "dots3_note": dict(num_key_value_heads=HEADS, vision_config=dict(adapter_out_dim=D), audio_config=dict(adapter_out_dim=D)),
    "dots3_note_text": dict(num_key_value_heads=HEADS),
    # (head_dim is the KDA heads' size and transformers saves it overwritten by qk_rope_head_dim: keep them equal)
    "bailing_hybrid": dict(qk_rope_head_dim=HEAD_DIM),
    # (the multimodal RoPE sections share qk_rope_head_dim / 2, split as the default 12:10:10)
    "hy_v4_vl": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5])),
    "hy_v4_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5])),
    # (its class has no default layer order; one short-convolution layer per attention layer)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * (LAYERS // 2)),
    # (RoPE on int(head_dim * 0.334) channels, even only at some head sizes: 96 -> 32, as 192 -> 64 in the release)
    "mimo_v2_flash": dict(head_dim=96),
    "zaya": dict(num_experts_per_tok=1),  # (the class takes top-1 routing only)
    "glm5_next": dict(num_key_value_heads=HEADS, qk_rope_head_dim=0),  # (MLA; its DSA layers are NoPE)
    "glm5_next_text": dict(num_key_value_heads=HEADS, qk_rope_head_dim=0),
    "deepseek_ocr2": dict(mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1)),  # (no default layer order)
    # (the text and the vision experts' widths; the RoPE sections share head_dim / 2, split as the default 22:22:20)
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[F_MOE, F_MOE],
                            rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[11, 11, 10])),
    # (the audio tower's output is the text model's input; the experts' pooled width, half the model's as released)
    "muse_spark": dict(audio_config=dict(out_hidden_size=D), moe_hidden_size=D // 2),
    # (the QSA indexer's sizes have no defaults)
    "qwen4_exp": dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=64,
                      indexer_compress_ratio=4),
    "qwen4_exp_text": dict(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=64,
                           indexer_compress_ratio=4),
    # (Gemma 4's MoE variant; its per-layer input embeddings over the vocab, as by default)
    "gemma4": dict(enable_moe_block=True, vocab_size_per_layer_input=VOCAB),
    "gemma4_text": dict(enable_moe_block=True, vocab_size_per_layer_input=VOCAB),
    # (no speech talker: transformers' talker class fails on its own default config; dynamoe does not load it)
    "qwen3_omni_moe": dict(enable_audio_output=False),
    # (Inkling-2: the head's unpadded rows within the vocab, the sliding layers' own sizes; the loop within 4 layers)
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS,
                          swa_head_dim=HEAD_DIM, n_layers_per_attn_res_block=2),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=HEADS,
                               swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, n_layers_per_attn_res_block=2,
                               loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=32),
}
# (Inkling-2's wrappers: their text models' sizes; the vision tower's output is the text model's input)
FAMILY_OVERRIDES["inkling2"] = {**FAMILY_OVERRIDES["inkling2_text"], "vision_config": dict(text_hidden_size=D)}
FAMILY_OVERRIDES["inkling2_loop"] = {**FAMILY_OVERRIDES["inkling2_loop_text"], "vision_config": dict(text_hidden_size=D)}
# families whose checkpoints come from another configuration class (step3p5: the text model of Step-3.7's wrapper)
CONFIG_OF = {"kimi_k2": "deepseek_v3", "step3p5": "step3p7"}
REFERENCE = "qwen3_moe"


def text_path(cls) -> tuple:
    """Where a configuration class keeps its text model's configuration: () for a text model, ("text_config",) for a
    multimodal wrapper, ("thinker_config", "text_config") for Qwen3-Omni's."""
    subs = getattr(cls, "sub_configs", None) or {}
    if "text_config" in subs:
        return ("text_config",)
    for name, sub in subs.items():
        inner = text_path(sub) if isinstance(sub, type) and getattr(sub, "sub_configs", None) else ()
        if inner:
            return (name, *inner)
    return ()


def build_config(family: str):
    """The family's configuration at these sizes: ``SIZES`` under the names its text configuration class takes, then
    ``FAMILY_OVERRIDES`` (a name only the wrapper takes -- ``vision_config`` -- goes to the wrapper)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    cls = CONFIG_MAPPING[CONFIG_OF.get(family, family)]
    path = text_path(cls)
    text = cls
    for name in path:
        text = text.sub_configs[name]
    picked = text is AutoConfig
    if picked:  # (Kimi-K2.5: any text model; the one its class builds by default)
        default = cls()
        for name in path:
            default = getattr(default, name)
        text = type(default)
    text_own = inspect.signature(text.__init__).parameters
    wrapper_own = inspect.signature(cls.__init__).parameters if path else {}
    overrides = FAMILY_OVERRIDES.get(family, {})
    kw = {**{k: v for k, v in SIZES.items() if k in text_own},
          **{k: v for k, v in overrides.items() if k not in wrapper_own or k in text_own}}
    if not path:
        return cls(**kw)
    if picked:
        kw["model_type"] = text.model_type  # (the wrapper picks its text config class by it)
    for name in reversed(path):
        kw = {name: kw}
    outer = {k: v for k, v in overrides.items() if k in wrapper_own and k not in text_own}
    if "tie_word_embeddings" in wrapper_own:
        outer.setdefault("tie_word_embeddings", False)
    return cls(**kw, **outer)


def model_class(cfg):
    """The transformers model class a checkpoint of ``cfg`` comes from: the causal-LM or image-text auto class's,
    else (a wrapper's text configuration, Qwen3-Omni's wrapper: classes no auto class maps) the class of the
    configuration's own modeling module that takes it -- one with an lm_head first, else its base model."""
    import importlib

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

    autos = (AutoModelForCausalLM, AutoModelForImageTextToText)
    for auto in autos[::-1] if text_path(type(cfg)) else autos:  # (a wrapper: the class of its checkpoints first)
        if type(cfg) in auto._model_mapping:
            return auto._model_mapping[type(cfg)]
    module = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    own = [c for name, c in vars(module).items() if isinstance(c, type) and issubclass(c, PreTrainedModel)
           and c.__dict__.get("config_class", getattr(c, "config_class", None)) is type(cfg)
           and "PreTrained" not in name]
    own.sort(key=lambda c: not c.__name__.endswith(("ForCausalLM", "ForConditionalGeneration")))
    if not own:
        raise ValueError(f"no transformers model class takes {type(cfg).__name__}")
    return own[0]


def conversions(model) -> list:
    """transformers' conversions between the family's checkpoints and its model's names (renamings, tensor
    layouts), as save_pretrained reverses them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def layout_model(skeleton, cfg, borrow: bool = False):
    """The model whose conversions give the checkpoint's tensor layout and where it keeps the text model: the model
    itself, or for a base text model that has none of its own (glm4v_moe_text: its checkpoints hold the wrapper's
    text part, under a causal LM's names) or when ``borrow`` says so, the wrapper (on the meta device)."""
    from transformers import CONFIG_MAPPING

    from transformers import PreTrainedModel

    if conversions(skeleton) and not borrow:
        return skeleton, None
    for wrapper in CONFIG_MAPPING.values():
        if (getattr(wrapper, "sub_configs", None) or {}).get("text_config") is type(cfg):
            with torch.device("meta"):
                outer = model_class(wrapper())._from_config(wrapper(text_config=cfg.to_dict()))
            at = next(n for n, m in outer.named_modules() if isinstance(m, PreTrainedModel) and type(m.config) is type(cfg))
            return outer, at
    return skeleton, None


def build_checkpoint(family: str, folder: str, rename: str = "all") -> None:
    """A random checkpoint of the family's text model, under the names its transformers class saves it. The class is
    built on the meta device; only its text model (the outermost submodule that takes the text configuration) and
    its lm_head are made and saved: the other parts of a multimodal wrapper (vision and audio towers, a speech
    talker: dynamoe does not load them, and some are billions of parameters at their default sizes) are left out."""
    from safetensors.torch import save_file
    from transformers import PreTrainedModel
    from transformers.core_model_loading import WeightConverter, WeightRenaming, revert_weight_conversion

    torch.manual_seed(0)
    cfg = build_config(family)
    cls = model_class(cfg)
    with torch.device("meta"):
        skeleton = cls._from_config(cfg)
    text_cfg = cfg
    for name in text_path(type(cfg)):
        text_cfg = getattr(text_cfg, name)
    prefix, text = min(((n, m) for n, m in skeleton.named_modules() if isinstance(m, PreTrainedModel)
                        and type(m.config) is type(text_cfg)), key=lambda nm: nm[0].count("."))
    place = prefix
    if prefix == "" and skeleton.get_output_embeddings() is None:
        prefix = "model"  # a base text model: the causal LM's names (model.*, lm_head)
    real = type(text)._from_config(text.config)
    with torch.no_grad():
        for p in real.parameters():  # (some initialisers leave zeros; every family gets the same random spread)
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.uniform_(0.9, 1.1)
    if prefix == "":  # the causal LM itself
        real.save_pretrained(folder, safe_serialization=True)
        return
    # the head: that of the text model's nearest enclosing model with one (Qwen3-Omni's thinker), else lm_head
    owners = [skeleton.get_submodule(".".join(place.split(".")[:i])) for i in range(place.count(".") + 1, -1, -1)]
    head = next((h for m in owners if isinstance(m, PreTrainedModel) for h in [m.get_output_embeddings()]
                 if h is not None), None)
    head_name = next((n for n, m in skeleton.named_modules() if m is head), "lm_head")
    tensors = {f"{prefix}.{k}": v for k, v in real.state_dict().items()}
    if not head_name.startswith(prefix + "."):
        rows, cols = head.weight.shape if head is not None else (text_cfg.vocab_size, text_cfg.hidden_size)
        tensors[head_name + ".weight"] = torch.randn(rows, cols) * 0.02
    # the checkpoint's names and tensor layout (what save_pretrained writes, reversing what transformers converts on
    # load): the tensor conversions (per-expert tensors); the renamings of the model's own over every name or
    # (rename="place") only on the text model's and the head's place in the wrapper (Kimi-K2.5's vision renaming
    # blocks -> layers must not reach the text layers). A base text model's checkpoint: under a causal LM's names,
    # or (rename="wrapper") as its wrapper writes it (Mistral-Large-4's text config: Mistral's own names)
    layout, at = layout_model(skeleton, cfg, borrow=rename == "wrapper")
    converters = [c for c in conversions(layout) if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions(layout) if isinstance(c, WeightRenaming)]
    if layout is not skeleton and rename != "wrapper":
        renamings = []
    layout._weight_conversions = (converters + (renamings if rename != "place" else [])) or None
    at = at or prefix
    if at != prefix:  # (a borrowed wrapper's conversions apply where it keeps the text model)
        tensors = {at + k[len(prefix):] if k.startswith(prefix + ".") else k: v for k, v in tensors.items()}
    tensors = revert_weight_conversion(layout, tensors)
    if at != prefix and rename != "wrapper":
        tensors = {prefix + k[len(at):] if k.startswith(at + ".") else k: v for k, v in tensors.items()}
    if rename == "place" and renamings:
        layout._weight_conversions = renamings
        moved = {p: next(iter(revert_weight_conversion(layout, {p + ".x": torch.zeros(())})))[:-2]
                 for p in (prefix, head_name)}
        tensors = {next((moved[p] + k[len(p):] for p in moved if k.startswith(p + ".")), k): v
                   for k, v in tensors.items()}
    seen = set()
    for k, v in tensors.items():  # (tied tensors: safetensors stores each storage once)
        tensors[k] = v.clone() if v.data_ptr() in seen else v.contiguous()
        seen.add(v.data_ptr())
    cfg.architectures = [cls.__name__]
    cfg.save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def time_decode(models: list, prefill: int, steps: int) -> list[float]:
    """Median ms per decode step of each model, their steps interleaved (a shared machine's load drifts: each
    model's steps see the same conditions), after two warm-up steps each."""
    ids = torch.randint(0, VOCAB, (1, prefill + steps + 2), generator=torch.Generator().manual_seed(0))
    slots = torch.zeros(1, dtype=torch.long)
    caches = [m.new_cache(1, ids.size(1)) for m in models]
    times = [[] for _ in models]
    with torch.no_grad():
        for m, c in zip(models, caches):
            m(ids[:, :prefill], cache=c, slots=slots)
        for t in range(prefill, ids.size(1)):
            for m, c, ts in zip(models, caches, times):
                t0 = time.perf_counter()
                m(ids[:, t:t + 1], cache=c, slots=slots)
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts[2:]) * 1e3 for ts in times]


def params(model) -> float:
    """Millions of parameters (the families' configs differ in what the shared sizes build: a column to read the
    times beside)."""
    return sum(p.numel() for p in model.parameters()) / 1e6


def describe(model) -> str:
    plan = model.__dict__.get("_plan")
    if plan and plan[2] is not None:
        return plan[2].describe()
    if plan:  # (DecodePlan.build declined: the kernels write the cache in the steps' dtype)
        return "no decode plan (the decode steps' hidden states are not in the cache's dtype)"
    return "no decode plan (the model's own forward)"


def load(family: str, dtype: torch.dtype, folder: str):
    """The family's model at these sizes, or the reason it could not be built (a string)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for rename in ("all", "place", "wrapper"):  # (the layouts a family's checkpoints may have: build_checkpoint)
                build_checkpoint(family, folder, rename)
                try:
                    return dynamoe.models.load(folder, dtype=dtype, progress=False)
                except ValueError as exc:
                    if "missing tensor" not in str(exc) or rename == "wrapper":
                        raise
    except Exception as exc:  # noqa: BLE001 (reported in the table: one family's failure is not the run's)
        return f"not built: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=None, help="families to time (default: every registered one)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    known = supported_families()
    families = args.families or known
    unknown = [f for f in families if f not in known]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; registered: {', '.join(known)}")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as ref_folder:
        ref = load(REFERENCE, dtype, ref_folder)
        if isinstance(ref, str):
            raise SystemExit(f"the reference {REFERENCE} failed: {ref}")
        ref_ms = time_decode([ref], args.prefill, args.steps)[0]
        print(f"| family | params (M) | layers fused | ms/token | {REFERENCE} ms/token beside it | ratio to {REFERENCE} "
              "| plan |")
        print("|---|---:|---|---:|---:|---:|---|")
        print(f"| {REFERENCE} | {params(ref):.0f} | {describe(ref).split(';')[0]} | {ref_ms:.2f} | {ref_ms:.2f} | 1.00 "
              f"| {describe(ref)} |", flush=True)
        for family in families:
            if family == REFERENCE:
                continue
            with tempfile.TemporaryDirectory() as folder:
                model = load(family, dtype, folder)
                if isinstance(model, str):
                    print(f"| {family} | - | - | - | - | - | {model} |", flush=True)
                    continue
                try:
                    ms, ref_ms = time_decode([model, ref], args.prefill, args.steps)
                except Exception as exc:  # noqa: BLE001 (as a build failure: reported, the run goes on)
                    print(f"| {family} | {params(model):.0f} | - | - | - | - | decode failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:150]} |", flush=True)
                    continue
                desc = describe(model)
                fused = desc.split(";")[0] if "layers fused" in desc else "-"
                print(f"| {family} | {params(model):.0f} | {fused} | {ms:.2f} | {ref_ms:.2f} | {ms / ref_ms:.2f} | {desc} |",
                      flush=True)


if __name__ == "__main__":
    main()
