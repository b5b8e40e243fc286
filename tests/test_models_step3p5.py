"""Step-3.5 (model_type step3p5) against transformers on tiny random checkpoints. transformers has no causal LM
of the text model alone: the reference is Step3p7ForConditionalGeneration (a tiny vision tower, text inputs
only), whose text model and lm_head are step3p5's; its saved checkpoint without the vision tensors, with the text
config as config.json, is a step3p5 checkpoint (the hub's names). Full and sliding layers with a RoPE each and
more query heads on the sliding ones, Gemma-style norms, per-head output gates, a softmax scale of its own, dense
and MoE layers (sigmoid routing with a selection bias, a route scale, a shared expert), SwiGLU clamps (routed and
shared apart); the hub's config names (moe_layers_enum, attention_other_setting, per-layer rope_theta lists padded
with an MTP entry, rope_scaling) and an MTP layer's tensors without its eh_proj (no head: left unread; whole MTP
layers load as draft heads, tests/test_models_mtp_layers.py)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import GatedMLP  # noqa: E402
from dynamoe.models.step3p5 import Step3p5Attention, Step3p5ForCausalLM, Step3p7ForCausalLM  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, head_dim=16, max_position_embeddings=256, pad_token_id=0, sliding_window=WINDOW)
VARIANTS = {
    # transformers' names (as it saves them): nested RoPE per layer type, explicit MLP kinds, clamps that clip
    "saved": dict(num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, share_expert_dim=24,
                  layer_types=LAYERS, num_sliding_attention_heads=8, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                  query_pre_attn_scalar=32, moe_router_scaling_factor=2.0,
                  swiglu_limits=[0, 0.5, None, 0.8], swiglu_limits_shared=[0.6, 0, 0.7, None],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
    # the hub's names: per-layer lists padded with one MTP entry, MoE layers by moe_layers_enum, the sliding heads in
    # attention_other_setting, llama3 scaling on the full layers' RoPE
    "hub": dict(moe_num_experts=8, moe_top_k=3, num_attention_groups=1, share_expert_dims=40, num_nextn_predict_layers=1,
                layer_types=LAYERS + ["full_attention"], moe_layers_enum="2,3,4",
                attention_other_setting={"num_attention_heads": 2}, rope_theta=[1e4, 300.0, 300.0, 1e4, 1e4],
                partial_rotary_factors=[0.5, 1.0, 1.0, 0.5, 0.5], swiglu_limits=[0, 0, 0.5, 0, 0],
                swiglu_limits_shared=[0, 0, 0, 0.5, 0],
                rope_scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8}),
}
SCALES = {"lm_head": 0.1, "embed_tokens": 0.5}
VISION_PREFIXES = ("vision_model.", "vit_large_projector.")


def _step3p5_folder(wrapper_dir: str, dst: str, text_config: dict, extra: dict | None = None) -> str:
    """The step3p5 checkpoint inside a saved Step3p7 one: its tensors without the vision tower's (plus ``extra``),
    ``text_config`` as config.json."""
    os.makedirs(dst)
    tensors = {k: v for k, v in load_file(os.path.join(wrapper_dir, "model.safetensors")).items()
               if not k.startswith(VISION_PREFIXES)}
    save_file({**tensors, **(extra or {})}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**text_config, "model_type": "step3p5"}, f)
    return dst


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    text = {**BASE, **VARIANTS[name]}
    torch.manual_seed(0)
    hf = transformers.Step3p7ForConditionalGeneration(
        transformers.Step3p7Config(text_config=dict(text), vision_config=VISION)).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n and "vision" not in n:
                p.sub_(1.0)  # zero-centred norms: randomize_ puts them near 1 (a scale near 2)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    root = tmp_path_factory.mktemp(f"step3p5_{name}")
    hf.save_pretrained(str(root / "wrapper"))
    if name == "saved":
        with open(root / "wrapper" / "config.json") as f:
            text_config = json.load(f)["text_config"]
        extra = None
    else:  # the hub's config as given, and tensors of a multi-token-prediction layer without eh_proj (not loaded)
        text_config, extra = text, {"model.layers.4.self_attn.q_proj.weight": torch.randn(64, 64),
                                    "model.layers.4.moe.gate.weight": torch.randn(8, 64)}
    path = _step3p5_folder(str(root / "wrapper"), str(root / "text"), text_config, extra)
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    cfg = ours.config
    assert type(ours) is Step3p5ForCausalLM and cfg.layer_types == tuple(LAYERS)
    attns = [layer.self_attn for layer in ours.model.layers]
    assert all(type(a) is Step3p5Attention for a in attns)
    sliding_heads = 8 if name == "saved" else 2
    assert [a.num_heads for a in attns] == [4, sliding_heads, sliding_heads, 4]
    assert [a.sliding_window for a in attns] == [None, WINDOW, WINDOW, None]
    assert [a.g_proj.out_features for a in attns] == [a.num_heads for a in attns]
    assert attns[0].scale == (32 ** -0.5 if name == "saved" else 16 ** -0.5)
    moe = [i for i, _ in ours.moe_layers()]
    assert moe == ([1, 2, 3] if name == "saved" else [2, 3])
    assert all(type(ours.model.layers[i].mlp) is GatedMLP for i in range(4) if i not in moe)
    ropes = {k: (r.rope_type, r.theta, r.partial_rotary_factor) for k, r in cfg.rope_by_layer_type}
    assert ropes == ({"full_attention": ("default", 1e4, 0.5), "sliding_attention": ("default", 500.0, 1.0)}
                     if name == "saved" else
                     {"full_attention": ("llama3", 1e4, 0.5), "sliding_attention": ("default", 300.0, 1.0)})
    for i, block in ours.moe_layers():
        gate, experts = block.moe.config.gates[0], block.moe.config.experts
        assert (gate.type, gate.k, gate.normalize, gate.n_group) == ("sigmoid", 2 if name == "saved" else 3, True, 1)
        assert gate.route_scale == (2.0 if name == "saved" else 1.0)
        assert block.moe.shared_experts.gate_proj.out_features == (24 if name == "saved" else 40)
        want = {"saved": {1: ("silu_clamp", 0.5, "silu", None), 2: ("silu", None, "silu_clamp", 0.7),
                          3: ("silu_clamp", 0.8, "silu", None)},
                "hub": {2: ("silu_clamp", 0.5, "silu", None), 3: ("silu", None, "silu_clamp", 0.5)}}[name][i]
        got = (experts.glu_activation, experts.gpt_oss_limit if experts.glu_activation == "silu_clamp" else None,
               block.moe.shared_experts.activation,
               block.moe.shared_experts.limit if block.moe.shared_experts.activation == "silu_clamp" else None)
        assert got == want


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_step3p7_checkpoint_loads_its_text_model(pair):
    """The Step-3.7 wrapper's own checkpoint (the hub's names, a vision tower) loads as its text model: the same
    logits and greedy tokens as transformers' wrapper on text, the vision tensors skipped."""
    _, hf, _, path = pair
    ours = dm.load(os.path.join(os.path.dirname(path), "wrapper"), progress=False)
    assert type(ours) is Step3p7ForCausalLM and ours.config.text_config_nested and ours.config.model_type == "step3p7"
    assert not ours.config.tie_word_embeddings
    check_logits(hf, ours, _ids())
    check_greedy(hf, ours, _ids(seed=1), new_tokens=16)


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the window, the output gates, the clamps and the selection bias each change
    the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
    attns = [layer.self_attn for layer in ours.model.layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                   lambda: [setattr(a, "sliding_window", WINDOW if a.layer_idx in (1, 2) else None) for a in attns])
    saved = [a.g_proj.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.g_proj.weight.data.fill_(30.0) for a in attns],  # every gate open: sigmoid = 1
                   lambda: [a.g_proj.weight.data.copy_(w) for a, w in zip(attns, saved)])
    clamped = [m for m in ours.modules() if getattr(m, "activation", None) == "silu_clamp"
               or getattr(m, "glu", None) == "silu_clamp"]
    assert clamped
    limits = [m.limit for m in clamped]
    assert differs(lambda: [setattr(m, "limit", 1e9) for m in clamped],
                   lambda: [setattr(m, "limit", v) for m, v in zip(clamped, limits)])
    biases = [b.moe.gates[0].e_score_correction_bias for _, b in ours.moe_layers()]
    kept = [b.clone() for b in biases]
    assert differs(lambda: [b.zero_() for b in biases], lambda: [b.copy_(k) for b, k in zip(biases, kept)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_kernels_take_every_layer(pair):
    """Both sub-blocks of every layer have their fused kernel: the attention's with its sigmoid gate per head and
    zero-centred norms, the MLP's with its zero-centred norm and SwiGLU clamps; a decode step runs them all fused."""
    ours = pair[2]
    h = torch.randn(1, 64)
    for layer in ours.model.layers:
        attn = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
        assert attn.weights is not None, attn.extra
        w = attn.weights
        assert w.gate_kind == attn.extra.GateKind.sigmoid and w.gate_per_head
        assert w.norm_zero_centered and w.qk_zero_centered
        mlp = layer.mlp.decode_fused(h, layer.post_attention_layernorm)
        assert mlp.weights is not None and mlp.weights.norm_zero_centered, mlp.extra
    cache = ours.new_cache(1, 8)
    with torch.no_grad():
        ours(torch.tensor([[1, 2]]), cache=cache, slots=torch.tensor([0]))
        ours(torch.tensor([[3]]), cache=cache, slots=torch.tensor([0]))
    assert ours.__dict__["_plan"][2].describe() == "4 of 4 layers fused"


def test_refusals(tmp_path):
    base = {"model_type": "step3p5", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 1}
    for extra, match in [({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                         ({"gating": "elementwise"}, "gating"),
                         ({"mlp_bias": True}, "mlp_bias"),
                         ({"num_sliding_attention_heads": 3, "layer_types": ["full_attention", "sliding_attention"],
                           "sliding_window": 4}, "multiple of num_key_value_heads"),
                         ({"swiglu_limits": [1.0]}, "swiglu_limits")]:
        with pytest.raises(ValueError, match=match):
            Step3p5ForCausalLM(dm.ModelConfig.from_dict({**base, **extra}))
    with pytest.raises(ValueError, match="rope_parameters"):  # transformers does not read a single dict either
        dm.ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    with pytest.raises(ValueError, match="moe_layers_enum"):
        dm.ModelConfig.from_dict({**base, "moe_layers_enum": "1,x"})


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill) gives transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
