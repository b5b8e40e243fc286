"""Nemotron-H against transformers on a tiny random checkpoint: single-sublayer blocks by pattern -- Mamba-2,
attention without position encoding, sigmoid-routed relu2 experts with a selection bias, a route scale and a relu2
shared expert, dense relu2 MLPs --, fp32-weight RMSNorms, the backbone.* names; and the Mamba state in the cache --
chunked prefill, decode, rows at different positions, a reused slot, the engine."""
import copy
import dataclasses

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot, check_rows_at_different_positions,
                            check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.models.mamba2 import Mamba2Mixer  # noqa: E402
from dynamoe.models.nemotron_h import NemotronHMoE, ReluSquaredMLP  # noqa: E402
from dynamoe.models.weights import PerExpertFFN, read_ffn_experts  # noqa: E402
from dynamoe.moe.experts import FFNExperts  # noqa: E402
from dynamoe.ops.activations import relu_squared  # noqa: E402

BLOCKS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, layers_block_type=BLOCKS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             moe_intermediate_size=16, moe_shared_expert_intermediate_size=20, mamba_num_heads=4, mamba_head_dim=16,
             ssm_state_size=8, n_groups=2, chunk_size=8, routed_scaling_factor=2.0, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _build(**extra):
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**SIZES, **extra})).eval()
    randomize_(hf, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for layer in hf.model.layers:
            if hasattr(layer.mixer, "gate"):
                layer.mixer.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = _build()
    path = save_tiny(hf, tmp_path_factory.mktemp("nemotron_h"))
    return hf, dm.load(path, progress=False), path


def test_structure(pair):
    _, ours, path = pair
    cfg = ours.config
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == tuple(BLOCKS) and cfg.num_hidden_layers == 6
    assert [type(layer.mixer) for layer in ours.model.layers] == [Mamba2Mixer, NemotronHMoE, Attention, ReluSquaredMLP,
                                                                   Mamba2Mixer, NemotronHMoE]
    assert [i for i, _ in ours.moe_layers()] == [1, 5]
    experts = ours.model.layers[1].mixer.moe.experts   # non-gated: up [E, F, D], down transposed [E, F, D]
    assert type(experts) is FFNExperts and experts.batched_fc1_w.shape == experts.batched_fc2_w.shape == (8, 16, 32)
    assert experts.batched_fc1_bias is None and experts.activation_fn is relu_squared
    assert not ours.model.layers[2].mixer.use_rope
    assert ours.checkpoint_name("model.layers.1.mixer.moe.gates.0.wg.weight") == "backbone.layers.1.mixer.gate.weight"
    assert ours.checkpoint_name("model.embed_tokens.weight") == "backbone.embeddings.weight"
    assert cfg.ssm.time_step_limit == (0.001, float("inf"))   # time_step_min below, nothing above
    assert cfg.kv_elements_per_position() == 2 * 2 * 8        # one attention block's keys and values
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert cfg.state_elements_per_sequence() == sizes == {"conv_state": 2 * (64 + 2 * 2 * 8) * 3,
                                                           "recurrent_state": 2 * 4 * 16 * 8}


def test_ffn_experts_read_a_range(pair):
    """Expert parallelism reads a contiguous range of the per-expert tensors: rows of the whole read."""
    from safetensors.torch import load_file

    tensors = load_file(f"{pair[2]}/model.safetensors")
    prefix = "backbone.layers.1.mixer.experts"
    whole = read_ffn_experts(tensors, None, prefix, PerExpertFFN(), 8, 16, 32, torch.float32, "cpu")
    part = read_ffn_experts(tensors, None, prefix, PerExpertFFN(), 8, 16, 32, torch.float32, "cpu", local=range(2, 6))
    assert torch.equal(part.w1, whole.w1[2:6]) and torch.equal(part.w2, whole.w2[2:6])
    assert torch.equal(whole.w1[3], tensors[f"{prefix}.3.up_proj.weight"])
    with pytest.raises(ValueError, match="contiguous range"):
        read_ffn_experts(tensors, None, prefix, PerExpertFFN(), 8, 16, 32, torch.float32, "cpu", local=range(6, 9))
    with pytest.raises(ValueError, match="expected shape"):
        read_ffn_experts(tensors, None, prefix, PerExpertFFN(), 8, 12, 32, torch.float32, "cpu")


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    check_chunked_prefill(pair[1], expect_states=4)   # two Mamba blocks, two states each


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


def test_hub_names_load(tmp_path):
    """The hub's config names -- hybrid_override_pattern, mamba_* aliases that win over the plain ones, a clamping
    mamba_dt_min -- give transformers' (prefill) logits."""
    hf = _build(mamba_dt_min=0.9, mamba_n_groups=4, n_groups=2, layers_block_type=None,
                hybrid_override_pattern="ME*-ME")
    assert hf.config.n_groups == 4 and hf.config.time_step_min == 0.9
    path = save_tiny(hf, tmp_path / "hub")
    ours = dm.load(path, progress=False)
    assert ours.config.ssm.n_groups == 4 and ours.config.ssm.time_step_limit == (0.9, float("inf"))
    check_logits(hf, ours, _ids())


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': relu2 (vs relu) in the experts and
    MLPs, the shared expert, the selection bias, the route scale, the groups of the Mamba norm."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(edit, model=ours):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for layer in m.model.layers:
                edit(layer.mixer)
            return float((m(ids) - hf(ids).logits).abs().max())

    def plain_relu(mixer):
        if isinstance(mixer, ReluSquaredMLP):
            mixer.forward = lambda x, m=mixer: m.down_proj(torch.relu(m.up_proj(x)))

    def no_edit(mixer):
        return None

    unscaled = type(ours)(dataclasses.replace(ours.config, routed_scaling_factor=1.0)).eval()
    unscaled.load_state_dict(ours.state_dict())
    assert far(no_edit) < 1e-4 and far(no_edit, unscaled) > 1e-2
    assert far(plain_relu) > 1e-2
    assert far(lambda m: m.shared_experts.down_proj.weight.zero_() if isinstance(m, NemotronHMoE) else None) > 1e-2
    assert far(lambda m: m.moe.gates[0].e_score_correction_bias.zero_() if isinstance(m, NemotronHMoE) else None) > 1e-2
    assert far(lambda m: setattr(m.norm, "groups", 1) if isinstance(m, Mamba2Mixer) else None) > 1e-2


def test_unsupported_fields():
    from dynamoe.models.registry import builder_for

    base = {"model_type": "nemotron_h", **{k: v for k, v in SIZES.items() if v is not None}}
    for extra, field in (({"moe_latent_size": 8}, "moe_latent_size"), ({"mlp_bias": True}, "mlp_bias"),
                         ({"mlp_hidden_act": "silu"}, "mlp_hidden_act")):
        cfg = dm.ModelConfig.from_dict({**base, **extra})
        with pytest.raises(ValueError, match=field):
            builder_for(cfg)(cfg)
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        dm.ModelConfig.from_dict({**{k: v for k, v in base.items() if k != "layers_block_type"},
                                  "hybrid_override_pattern": "MX"})
