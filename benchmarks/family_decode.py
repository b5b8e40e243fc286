"""Decode speed of every registered family at one small-but-not-tiny size, next to Qwen3-MoE's (the fused reference),
and which of its layers run fused (the DecodePlan's summary).

    python benchmarks/family_decode.py [--families qwen3_moe laguna ...] [--steps 32] [--prefill 64] [--dtype bfloat16]

Each family is built from its transformers configuration class (the text config of a multimodal wrapper) with the
sizes of ``SIZES`` -- hidden 512, 4 layers, 8 heads / 2 KV heads of 64, 8 experts top-2 of 512, vocab 4096 -- under
whichever of their names the configuration class takes (``FAMILY_OVERRIDES`` for the few that need more), random weights,
saved as safetensors to a temporary folder and loaded by ``dynamoe.models.load`` in ``--dtype``. Batch 1: a
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
    "longcat_flash": dict(num_layers=LAYERS, ffn_hidden_size=F_DENSE, expert_ffn_hidden_size=F_MOE),
    "dots3_note": dict(num_key_value_heads=HEADS),  # (MLA: as many KV heads as query heads)
    "dots3_note_text": dict(num_key_value_heads=HEADS),
    # (Inkling-2: the head's unpadded rows within the vocab, the sliding layers' own sizes; the loop within 4 layers)
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS,
                          swa_head_dim=HEAD_DIM, n_layers_per_attn_res_block=2),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=HEADS,
                               swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, n_layers_per_attn_res_block=2,
                               loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=32),
}
# families whose checkpoints come from another configuration class (step3p5: the text model of Step-3.7's wrapper)
CONFIG_OF = {"kimi_k2": "deepseek_v3", "step3p5": "step3p7"}
REFERENCE = "qwen3_moe"


def build_config(family: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[CONFIG_OF.get(family, family)]
    text = getattr(cls, "sub_configs", {}).get("text_config")  # a multimodal wrapper: the sizes are its text model's
    own = inspect.signature((text or cls).__init__).parameters
    kw = {**{k: v for k, v in SIZES.items() if k in own}, **FAMILY_OVERRIDES.get(family, {})}
    if text is not None:
        return cls(text_config=kw, tie_word_embeddings=False)
    return cls(**kw)


def build_checkpoint(family: str, folder: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = build_config(family)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    except ValueError:  # wrappers that only the image-text auto class knows
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():  # (some initialisers leave zeros; every family gets the same random spread)
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.uniform_(0.9, 1.1)
    model.save_pretrained(folder, safe_serialization=True)


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
    return plan[2].describe() if plan and plan[2] is not None else "no decode plan (the model's own forward)"


def load(family: str, dtype: torch.dtype, folder: str):
    """The family's model at these sizes, or the reason it could not be built (a string)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_checkpoint(family, folder)
        return dynamoe.models.load(folder, dtype=dtype, progress=False)
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
