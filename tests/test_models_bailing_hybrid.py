"""Ling-3 (bailing_hybrid) against transformers on tiny random checkpoints: Kimi Delta Attention with the bounded
(or softplus) forget gate and a full-rank output gate, MLA with a sigmoid gate per head and interleaved RoPE,
DeepSeek-V3 routing with shared experts under Kimi-Linear's names; the hub's names (attention.*, dense,
word_embeddings, gate.expert_bias); and the KDA state in the cache -- chunked prefill, decode, rows at different
positions, a reused slot, the engine."""
import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot, check_rows_at_different_positions,
                            check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.bailing_hybrid import BailingDeltaAttention  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

# head_dim (the KDA heads' size) = qk_rope_head_dim: transformers saves head_dim overwritten by qk_rope_head_dim and
# re-reads it as the KDA size, so only equal sizes survive its own save / load round trip
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=8, head_dim=8, layer_group_size=2, num_mtp_layers=0, routed_scaling_factor=2.0,
             max_position_embeddings=256, pad_token_id=None, eos_token_id=None)
VARIANTS = {"safe-gate": {}, "softplus-gate-q-lora": dict(kda_safe_gate=False, q_lora_rank=12)}
# (a small lm_head, as tests/test_models_qwen3_next.py: the delta rule's fp32 rounding, amplified by random layers,
# is otherwise close to 1e-4 at the logit scale N(0, 0.2) weights give)
SCALES = {"lm_head": 0.05}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(**SIZES, **VARIANTS[request.param]))
    hf = hf.eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"bailing_{request.param}"))
    return hf, dm.load(path, progress=False), path


def test_structure(pair):
    hf, ours, _ = pair
    cfg = ours.config
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert [type(layer.self_attn) for layer in ours.model.layers] == [BailingDeltaAttention, MLAttention] * 2
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    kda = ours.model.layers[0].self_attn
    assert kda.safe_gate == hf.config.kda_safe_gate and kda.q_conv1d.weight.dtype == torch.float32
    assert ours.model.layers[1].self_attn.g_proj.weight.shape == (4, 32)
    assert (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim) == (4, 8, 4)
    assert cfg.rope.theta == 6e6 and cfg.routed_scaling_factor == 2.0 and cfg.n_group == 2
    assert ours.checkpoint_name("model.layers.1.self_attn.o_proj.weight") == "model.layers.1.attention.dense.weight"


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    check_chunked_prefill(pair[1], expect_states=4)   # two KDA layers, two states each


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


def test_mtp_layers_are_not_loaded(pair, tmp_path):
    """Tensors of a layer after the decoder's (model.layers.{num_hidden_layers}) without the eh_proj of an MTP layer:
    no head is built, the checkpoint loads with those tensors unread (logged), the model unchanged. (Whole MTP layers
    load as heads: tests/test_models_mtp_layers.py.)"""
    _, ours, path = pair
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.symlink(os.path.join(path, name), tmp_path / name)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    extra = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.3.")}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
    model = dm.load(tmp_path, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), ours(_ids()), atol=0, rtol=0)


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the forget gate's form, the KDA
    output gate, the MLA head gate, the selection bias."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(edit):
        m = copy.deepcopy(ours)
        with torch.no_grad():
            for layer in m.model.layers:
                edit(layer)
            return float((m(ids) - hf(ids).logits).abs().max())

    def flip_gate(layer):
        if isinstance(layer.self_attn, BailingDeltaAttention):
            layer.self_attn.safe_gate = not layer.self_attn.safe_gate

    assert far(lambda layer: None) < 1e-4
    assert far(flip_gate) > 1e-2
    assert far(lambda layer: layer.self_attn.g_proj.weight.zero_()) > 1e-2   # KDA and MLA gates: sigmoid(0) = 1/2
    assert far(lambda layer: layer.self_attn.g_proj.weight.zero_()
               if isinstance(layer.self_attn, MLAttention) else None) > 1e-2
    assert far(lambda layer: layer.mlp.moe.gates[0].e_score_correction_bias.zero_()
               if isinstance(layer.mlp, SparseMoeBlock) else None) > 1e-2


def test_bad_config():
    from dynamoe.models.registry import builder_for

    base = {"model_type": "bailing_hybrid", **{k: v for k, v in SIZES.items() if v is not None}}
    cfg = dm.ModelConfig.from_dict({**base, "kda_safe_gate": "yes"})
    with pytest.raises(ValueError, match="kda_safe_gate"):
        builder_for(cfg)(cfg)
    cfg = dm.ModelConfig.from_dict({**base, "kda_lower_bound": 1.0})
    with pytest.raises(ValueError, match="kda_lower_bound"):
        builder_for(cfg)(cfg)
