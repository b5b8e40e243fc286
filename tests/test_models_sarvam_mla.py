"""Sarvam-105B (``sarvam_mla``) against transformers on tiny random checkpoints: transformers builds its
DeepseekV3ForCausalLM from a SarvamMLAConfig (MLA without query LoRA by default, sigmoid routing with a selection
bias, one dense layer, shared experts); the hub's config names (num_experts, num_shared_experts, num_mtp_layers,
a 'deepseek_yarn' rope_scaling, a head_dim it does not read) parse as transformers reads them."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import BASE, MLA, edit_config, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402

HUB_YARN = {"type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {
    # Sarvam's defaults: q_proj (no query LoRA), one group, interleaved RoPE
    "plain": dict(**{**MLA, "q_lora_rank": None}),
    # the hub's spelling of the config, written over the saved one (see the fixture)
    "hub": dict(**{**MLA, "q_lora_rank": None}, n_group=4, topk_group=2, n_shared_experts=2),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    sizes = {k: v for k, v in BASE.items() if k not in ("n_shared_experts", "n_routed_experts")}
    cfg = transformers.SarvamMLAConfig(**sizes, n_routed_experts=8, **VARIANTS[name],
                                       **({"rope_scaling": HUB_YARN} if name == "hub" else {}))
    hf, path = make_pair(transformers.DeepseekV3ForCausalLM, cfg, tmp_path_factory.mktemp(f"sarvam_{name}"))
    if name == "hub":  # the names of sarvamai/sarvam-105b's config.json (transformers reads them alike)
        edit_config(path, n_routed_experts=None, n_shared_experts=None, rope_parameters=None, num_experts=8,
                    num_shared_experts=2, num_mtp_layers=0, rope_scaling=HUB_YARN, head_dim=40, q_head_dim=24,
                    rope_theta=10000.0)
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is DeepseekV3ForCausalLM and ours.config.model_type == "sarvam_mla"
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and hasattr(attn, "q_proj") and attn.rope_interleaved
    assert ours.config.rope.rope_type == ("yarn" if name == "hub" else "default")
    assert ours.config.n_shared_experts == hf.config.n_shared_experts
    assert ours.config.num_experts == 8 and ours.config.head_dim == 8


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


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


def test_hub_yarn_matters(pair):
    """The 'deepseek_yarn' scaling is read (not dropped): plain RoPE gives other logits."""
    name, hf, ours, path = pair
    if name != "hub":
        assert ours.config.rope.rope_type == "default"
        return
    edit_config(path, rope_scaling={"rope_type": "default", "rope_theta": 10000.0})
    try:
        plain = dm.load(path, progress=False)
    finally:
        edit_config(path, rope_scaling=HUB_YARN)
    x = ids()
    with torch.no_grad():
        assert (plain(x) - ours(x)).abs().max() > 1e-3
