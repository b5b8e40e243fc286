"""The CPU decode path of loaded models: logits_to_keep, and bf16 linears through dynamoe.ops.linear
(the bf16 GEMV kernel) giving transformers' bf16 results within bf16 rounding."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_, save_tiny

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.linear import Linear  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    randomize_(hf, seed=1)
    return save_tiny(hf, tmp_path_factory.mktemp("qwen3_decode"))


def test_logits_to_keep(folder):
    model = dm.load(folder, progress=False)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(model(ids, logits_to_keep=1), full[:, -1:])
        torch.testing.assert_close(model(ids, logits_to_keep=3), full[:, -3:])
        torch.testing.assert_close(model(ids, logits_to_keep=0), full)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)


def test_bf16_decode_matches_fp32_within_bf16_rounding(folder):
    ours16 = dm.load(folder, dtype=torch.bfloat16, progress=False)
    ours32 = dm.load(folder, progress=False)
    assert all(type(m) is Linear for m in ours16.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    c16, c32 = ours16.new_cache(1, 32), ours32.new_cache(1, 32)
    with torch.no_grad():
        ours16(ids[:, :-1], cache=c16)
        ours32(ids[:, :-1], cache=c32)
        a = ours16(ids[:, -1:], cache=c16).float()   # one row: the kernel path
        b = ours32(ids[:, -1:], cache=c32)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


def _attentions(model):
    return [m for m in model.modules() if hasattr(m, "fuse_qkv_")]


def test_qkv_fused_into_one_buffer_with_the_same_parameters(folder):
    from safetensors.torch import load_file

    model = dm.load(folder, progress=False)
    on_disk = load_file(f"{folder}/model.safetensors")
    for attn in _attentions(model):
        weight, bias = attn._qkv
        assert bias is None and weight.shape == (4 * 16 + 2 * 2 * 16, 64)
        assert attn._still_fused(attn._qkv)
    sd = model.state_dict()
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{name}.weight"
        torch.testing.assert_close(sd[key], on_disk[key], rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fused = model(ids)
        # a parameter replaced: that layer falls back to three matmuls with the new weight
        attn = _attentions(model)[0]
        new_w = torch.randn_like(attn.k_proj.weight)
        attn.k_proj.weight = torch.nn.Parameter(new_w, requires_grad=False)
        changed = model(ids)
        assert attn._qkv is None
        reference = dm.load(folder, progress=False)
        reference.model.layers[0].self_attn.k_proj.weight.copy_(new_w)  # in place: the fused view sees it
        torch.testing.assert_close(reference(ids), changed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fused, changed)


@pytest.mark.parametrize("window", [None, 5])
def test_one_sequence_decode_equals_recompute(tmp_path, window):
    """The one-row decode step (a plain cache copy, no mask when every key is visible) against the
    full forward, also with a sliding window shorter than the sequence (the mask is needed there)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128, sliding_window=window,
                                     bos_token_id=None, eos_token_id=None)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    randomize_(hf, seed=3)
    model = dm.load(save_tiny(hf, tmp_path), progress=False)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(2, 32)
    slot = torch.tensor([1])
    with torch.no_grad():
        full = model(ids)
        model(ids[:, :4], cache=cache, slots=slot)
        for t in range(4, 12):
            step = model(ids[:, t:t + 1], cache=cache, slots=slot)
            torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
