"""Sarvam-30B against transformers (its Glm4MoeForCausalLM with SarvamMoEConfig) on tiny random checkpoints in the
hub's layout: fused query_key_value rows read as q, k and v, Sarvam's names for the o_proj, q/k norms, embeddings and
selection bias; q/k norms, whole-head RoPE, a dense first layer, DeepSeek-style sigmoid routing with shared experts."""
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.models.sarvam_moe import SarvamMoeForCausalLM  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "plain": dict(),
    # q/k/v biases (fused on disk too), 4 groups of which 2 kept, two shared experts, no q/k norm, other RoPE base
    "biased": dict(use_qkv_bias=True, n_group=4, topk_group=2, num_shared_experts=2, use_qk_norm=False,
                   routed_scaling_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}
SCALES = {"lm_head": 0.2, "word_embeddings": 1.0, "embed_tokens": 1.0}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.Glm4MoeForCausalLM(transformers.SarvamMoEConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"sarvam_moe_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_checkpoint_is_in_the_hub_layout(pair):
    """What the test loads is Sarvam's layout (fused q/k/v, its names), not GLM-4.5's."""
    with safe_open(os.path.join(pair[3], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.word_embeddings.weight" in names and "model.layers.0.attention.query_key_value.weight" in names
    assert "model.layers.1.mlp.gate.expert_bias" in names and not any(".q_proj." in n for n in names)


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is SarvamMoeForCausalLM
    layers = ours.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    for layer in layers:
        attn = layer.self_attn
        assert (attn.q_norm is None) == (name == "biased") and (attn.q_proj.bias is not None) == (name == "biased")
        assert attn.o_proj.bias is None
    gate = layers[1].mlp.moe.config.gates[0]
    want = (4, 2, 1.5) if name == "biased" else (1, 1, 2.5)
    assert (gate.type, gate.n_group, gate.topk_group, gate.route_scale) == ("sigmoid", *want)
    assert ours.model.rotary_emb.inv_freq.numel() == 8   # the whole head of 16


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


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: q, k and v come from their own rows of the fused tensor (a swap of two KV heads'
    rows changes the logits), and the selection bias and q/k norms matter."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    attns = [layer.self_attn for layer in ours.model.layers]
    kept = [a.k_proj.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.k_proj.weight.data.copy_(a.k_proj.weight.data.view(2, 16, -1).flip(0).reshape(32, -1))
                            for a in attns],
                   lambda: [a.k_proj.weight.data.copy_(k) for a, k in zip(attns, kept)])
    gates = [b.moe.gates[0] for _, b in ours.moe_layers()]
    bias = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, bias)])
    if name == "plain":
        norms = [a.k_norm.weight.detach().clone() for a in attns]
        assert differs(lambda: [a.k_norm.weight.data.fill_(1.0) for a in attns],
                       lambda: [a.k_norm.weight.data.copy_(w) for a, w in zip(attns, norms)])


def test_fused_qkv_of_the_wrong_size_is_refused(pair, tmp_path):
    """A query_key_value tensor with rows other than (H + 2K) d is an error naming it, not a silent slice."""
    _, _, _, path = pair
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    name = "model.layers.0.attention.query_key_value.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:16]])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="query_key_value"):
        dm.load(str(tmp_path), progress=False)


def test_hub_names_in_the_config():
    """Sarvam's own config names (num_experts, num_shared_experts, use_qkv_bias, num_mtp_layers) read as
    transformers' attribute_map reads them."""
    cfg = dm.ModelConfig.from_dict({"model_type": "sarvam_moe", "vocab_size": 8, "hidden_size": 16,
                                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 2,
                                    "use_qkv_bias": True,
                                    "num_mtp_layers": 1})
    assert (cfg.num_experts, cfg.n_shared_experts, cfg.attention_bias, cfg.num_nextn_predict_layers) == (4, 2, True, 1)
    assert (cfg.rope.theta, cfg.rope.partial_rotary_factor, cfg.use_qk_norm) == (8e6, 1.0, True)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    ours = pair[2]
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
            assert fused.weights is not None, fused.extra


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


@pytest.mark.parametrize("pair", ["plain"], indirect=True)   # one layout is enough
def test_mtp_layers_build_no_head_and_are_logged(pair, tmp_path, caplog):
    """A checkpoint with a DeepSeek-style MTP layer (model.layers.{N}: eh_proj and the rest): Sarvam's MTP
    architecture has no public source, so no head is built (not GLM-4.5's, which the class inherits); the layer's
    tensors are left unread and the log says why and how many."""
    import logging
    import shutil

    from models_mla_util import add_mtp_layers

    name, _, ours, path = pair
    other = str(tmp_path / "mtp")
    shutil.copytree(path, other)
    add_mtp_layers(other, seed=2, copies=False, embed="model.word_embeddings.weight")
    with caplog.at_level(logging.INFO):
        model = dm.load(other, progress=False)
    assert not model.has_mtp
    assert "Sarvam's multi-token-prediction architecture has no public source" in caplog.text
    assert "not loading" in caplog.text and "model.layers.[3]" in caplog.text
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x), atol=0, rtol=0)
