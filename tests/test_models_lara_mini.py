"""Lara-4-Mini against transformers on tiny random checkpoints: Gated DeltaNet layers (the fused in_proj / out_norm
tensors transformers saves, and the split names), sliding RoPE and full NoPE attention layers with per-head q/k norms,
fp32-weight RMSNorms, softmax routing with an ungated shared expert; and the recurrent state in the cache -- chunked
prefill, decode, rows at different positions, a reused slot, the engine, bf16."""
import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot,
                            check_rows_at_different_positions, check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.lara_mini import LaraAttention, LaraMiniForCausalLM  # noqa: E402
from dynamoe.models.linear_attention import GatedDeltaNet  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, sliding_window=6, linear_conv_kernel_dim=3, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    # the released layer pattern, renormalised top-k, tied embeddings
    "released": dict(),
    # another pattern (two full NoPE layers), raw top-k probabilities, untied, biases on the attention
    "mixed": dict(layer_types=["full_attention", "linear_attention", "sliding_attention", "linear_attention",
                               "full_attention"], norm_topk_prob=False, tie_word_embeddings=False, attention_bias=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LaraMiniForCausalLM(transformers.LaraMiniConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.2, "A_log": 0.5})
    path = save_tiny(hf, tmp_path_factory.mktemp(f"lara_mini_{request.param}"))
    return hf, dm.load(path, progress=False), path


def test_structure(pair):
    hf, ours, path = pair
    cfg = ours.config
    assert type(ours) is LaraMiniForCausalLM and type(ours).recurrent_state is True
    assert list(cfg.layer_types) == hf.config.layer_types
    for kind, layer in zip(cfg.layer_types, ours.model.layers):
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        assert type(mixer) is (GatedDeltaNet if kind == "linear_attention" else LaraAttention)
        if kind != "linear_attention":
            assert mixer.use_rope == (kind == "sliding_attention")
            assert mixer.sliding_window == (6 if kind == "sliding_attention" else None)
            assert mixer.q_norm.weight_in_fp32 and (mixer.o_proj.bias is not None) == hf.config.attention_bias
        else:
            assert mixer.norm.weight_in_fp32
        assert type(layer.mlp) is SparseMoeBlock and layer.mlp.moe.config.gates[0].normalize == hf.config.norm_topk_prob
        assert layer.mlp.moe.shared_experts.gate_proj.out_features == 24
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings == (ours.lm_head.weight is ours.model.embed_tokens.weight)
    names = load_file(f"{path}/model.safetensors")
    assert any(n.endswith(".linear_attn.in_proj.weight") for n in names) and ours.fused_in_proj   # (transformers saves so)
    attn = sum(t != "linear_attention" for t in cfg.layer_types)
    assert cfg.kv_elements_per_position() == attn * 2 * 2 * 16


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    # chunks of 1 and 2 tokens: shorter than and equal to the conv window of 2
    check_chunked_prefill(pair[1], cuts=((0, 13), (13, 14), (14, 16), (16, 28)), expect_states=4)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])


def test_rows_at_different_positions_in_one_chunk(pair):
    check_rows_at_different_positions(pair[1])


def test_reused_slot_starts_from_zero_state(pair):
    check_reused_slot(pair[1])


def test_truncated_slot_is_an_error(pair):
    check_truncated_slot_is_an_error(pair[1])


def test_engine_generates_each_requests_own_continuation(pair):
    check_engine(pair[1])


def test_bf16_tracks_transformers_bf16(pair):
    check_bf16(pair[0], pair[2])


def test_split_checkpoint_names_load(pair, tmp_path):
    """A checkpoint with the split projections and ``norm`` (transformers' module names) loads to the same model."""
    _, ours, path = pair
    tensors = load_file(f"{path}/model.safetensors")
    lin = ours.model.layers[ours.config.layer_types.index("linear_attention")].linear_attn
    sizes = [lin.in_proj_qkv.out_features, lin.in_proj_z.out_features, lin.in_proj_b.out_features,
             lin.in_proj_a.out_features]
    split = {}
    for name, t in tensors.items():
        if name.endswith(".linear_attn.in_proj.weight"):
            for part, chunk in zip(("qkv", "z", "b", "a"), t.split(sizes)):
                split[name.replace(".in_proj.", f".in_proj_{part}.")] = chunk.contiguous()
        else:
            split[name.replace(".linear_attn.out_norm.", ".linear_attn.norm.")] = t
    save_file(split, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    other = dm.load(tmp_path, progress=False)
    assert not other.fused_in_proj
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(other(x), ours(x), atol=0, rtol=0)


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': NoPE on the full layers (RoPE there
    instead), the fp32 gated norm's weight, the q/k norms, the shared expert."""
    hf, ours, _ = pair
    ids = _ids()

    def far(model):
        with torch.no_grad():
            return float((model(ids) - hf(ids).logits).abs().max())

    def edited(edit):
        m = copy.deepcopy(ours)
        for kind, layer in zip(m.config.layer_types, m.model.layers):
            edit(kind, layer)
        return m

    assert far(ours) < 1e-4
    if "full_attention" in ours.config.layer_types:
        def roped(m):
            for kind, layer in zip(m.config.layer_types, m.model.layers):
                if kind == "full_attention":
                    layer.self_attn.use_rope = True
                    object.__setattr__(layer.self_attn, "rotary", m.model.rotary_emb)
            return m

        assert far(roped(copy.deepcopy(ours))) > 1e-2
    assert far(edited(lambda kind, layer: layer.linear_attn.norm.weight.data.fill_(1.0)
                      if kind == "linear_attention" else None)) > 1e-2
    assert far(edited(lambda kind, layer: setattr(layer.self_attn, "q_norm", None) or
                      setattr(layer.self_attn, "k_norm", None) if kind != "linear_attention" else None)) > 1e-2
    assert far(edited(lambda kind, layer: layer.mlp.moe.shared_experts.down_proj.weight.data.zero_())) > 1e-2


def test_config_defaults_and_kinds():
    """A config with only the sizes: LaraMiniConfig's defaults (its released layer pattern, 128 experts, top-4, tied)."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=7, num_attention_heads=8)
    t = transformers.LaraMiniConfig(**sizes)
    cfg = dm.ModelConfig.from_dict({"model_type": "lara_mini", **sizes})
    assert list(cfg.layer_types) == t.layer_types
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
            cfg.norm_topk_prob, cfg.tie_word_embeddings, cfg.sliding_window, cfg.head_dim) == \
        (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.shared_expert_intermediate_size,
         t.norm_topk_prob, t.tie_word_embeddings, t.sliding_window, t.head_dim)
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({"model_type": "lara_mini", **sizes, "layer_types": ["lightning"] * 7})
