"""GPT-OSS against transformers on a tiny random checkpoint: attention sinks, a sliding window (8)
shorter than the input (24), alternating sliding/full layers, YaRN, q/k/v/o biases, a biased router,
and clamped SwiGLU experts whose clamp really clips."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402

WINDOW, LIMIT = 8, 7.0
# big gate/up weights so that |gate|, |up| > swiglu_limit happens; small down weights keep the output sane
SCALES = {"experts.gate_up_proj": 0.5, "experts.down_proj": 0.05, "sinks": 1.0}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
              swiglu_limit=LIMIT, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.GptOssConfig(**kw)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(tiny_config()).eval()
    randomize_(hf, seed=3, scales=SCALES)
    return hf, dm.load(save_tiny(hf, tmp_path_factory.mktemp("gpt_oss")), progress=False)


def test_config_and_structure(pair):
    _, ours = pair
    cfg = ours.config
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 32 and cfg.rope.truncate is False
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    assert windows == [WINDOW, None, WINDOW]
    attn = ours.model.layers[0].self_attn
    assert attn.sinks is not None and attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert abs(ours.model.rotary_emb.attention_scaling - (0.1 * torch.log(torch.tensor(32.0)).item() + 1)) < 1e-6
    experts = ours.model.layers[0].mlp.moe.experts
    assert experts.activation == "gpt_oss" and experts.limit == LIMIT and experts.gate_up_proj_bias is not None


def test_clamp_clips(pair):
    """The random weights drive the experts' gate and up projections past swiglu_limit."""
    hf, _ = pair
    seen = []

    def hook(module, args):
        x, ids = args[0], args[1]
        gu = torch.einsum("td,tkdf->tkf", x, module.gate_up_proj[ids]) + module.gate_up_proj_bias[ids]
        seen.append(gu)

    handles = [layer.mlp.experts.register_forward_pre_hook(hook) for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(_ids())
    finally:
        for h in handles:
            h.remove()
    gu = torch.cat([s.reshape(-1, s.size(-1)) for s in seen])
    gate, up = gu[:, ::2], gu[:, 1::2]
    assert (gate > LIMIT).float().mean() > 0.01 and (up.abs() > LIMIT).float().mean() > 0.01


def test_sinks_and_window_matter(pair):
    """Sanity of the test itself: without sinks, or without the window, the logits change a lot."""
    _, ours = pair
    ids = _ids()
    attn = ours.model.layers[0].self_attn
    with torch.no_grad():
        ref = ours(ids)
        sinks, attn.sinks = attn.sinks, None
        no_sinks = ours(ids)
        attn.sinks = sinks
        attn.sliding_window = None
        no_window = ours(ids)
        attn.sliding_window = WINDOW
    assert (no_sinks - ref).abs().max() > 1e-2 and (no_window - ref).abs().max() > 1e-2


def test_logits_match_transformers(pair):
    check_logits(*pair, _ids())


def test_greedy_matches_generate(pair):
    check_greedy(*pair, _ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=5)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])
