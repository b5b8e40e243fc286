"""Multi-token-prediction heads (dynamoe.models.mtp) of the DeepSeek-style families on tiny random checkpoints with
MTP layers written beside transformers' tensors (it saves none): they load (sharing the model's embedding /
lm_head copies), leave the model's output alone, and their drafts -- the cached, batched path the engine runs --
equal a from-scratch float64 recomputation without any cache; bad MTP layouts are refused by name."""
import shutil

import pytest
import torch

from models_util import check_mtp_drafts, one_thread  # noqa: F401 (autouse fixture)
from models_mla_util import BASE, MLA, add_mtp_layers, edit_config, ids, make_pair, reference_mtp_drafts

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402

FAMILIES = {
    "deepseek_v3": lambda: (transformers.DeepseekV3ForCausalLM,
                            transformers.DeepseekV3Config(**{**BASE, **MLA, "n_group": 2, "topk_group": 1})),
    "glm4_moe": lambda: (transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig(
        vocab_size=BASE["vocab_size"], hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256,
        attention_bias=True, use_qk_norm=True, bos_token_id=None, eos_token_id=None)),
    # the head's layer has its own sparse-attention indexer (keeping 6 of the keys: it prunes here)
    "deepseek_v32": lambda: (transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(
        **{**BASE, **MLA, "mlp_layer_types": ["dense", "sparse", "sparse"], "index_topk": 6, "index_head_dim": 16,
           "index_n_heads": 4})),
    # GLM-5: the last decoder layer reuses the previous indexer's selection; the head's layer runs its own
    "glm_moe_dsa": lambda: (transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig(
        **{**BASE, **MLA, "index_topk": 6, "index_head_dim": 16, "index_n_heads": 4,
           "indexer_types": ["full", "full", "shared"]})),
    # GLM-4.7-Flash: DeepSeek-V3's layout under GLM's defaults (only layer 0 dense)
    "glm4_moe_lite": lambda: (transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig(
        **{k: v for k, v in BASE.items() if k != "first_k_dense_replace"}, **MLA, n_group=2, topk_group=1)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model without heads, model with one MTP head, the folder with heads)."""
    cls, cfg = FAMILIES[request.param]()
    _, plain = make_pair(cls, cfg, tmp_path_factory.mktemp(f"{request.param}_plain"))
    path = str(tmp_path_factory.mktemp(f"{request.param}_mtp"))
    shutil.copytree(plain, path, dirs_exist_ok=True)
    add_mtp_layers(path, seed=3)
    return request.param, dm.load(plain, progress=False), dm.load(path, progress=False), path


def test_heads_load_share_and_leave_the_model_alone(family, tmp_path):
    name, plain, model, path = family
    assert not plain.has_mtp and model.has_mtp and len(model.mtp) == 1
    head = model.mtp[0]
    assert isinstance(head.block.mlp, SparseMoeBlock)   # DeepSeek's and GLM's MTP layers are MoE layers
    assert head.block.self_attn.layer_idx == 3
    # sparse attention: the head's layer runs an indexer where the checkpoint has one for it (here: copied from the
    # last decoder layer, which has its own in V3.2 and shares the previous one's in this GLM-5 config)
    assert (getattr(head.block.self_attn, "indexer", None) is not None) == (name == "deepseek_v32")
    # the checkpoint's copies of the embedding and lm_head are the model's own tensors after loading
    assert head.embed_tokens is model.model.embed_tokens and head.shared_head.head is model.lm_head
    assert len(plain.new_cache(1, 16).layers) == 3 and len(model.new_cache(1, 16).layers) == 4
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=0, rtol=0)
        logits, hidden = model(x, return_hidden=True, logits_to_keep=1)
        torch.testing.assert_close(logits, plain(x, logits_to_keep=1), atol=0, rtol=0)
        torch.testing.assert_close(model.lm_head(hidden), plain(x), atol=1e-5, rtol=1e-5)
    # a depth without its own embedding / lm_head copies reads the model's
    other = str(tmp_path / "nocopies")
    shutil.copytree(path, other)
    from safetensors.torch import load_file, save_file
    t = load_file(other + "/model.safetensors")
    del t["model.layers.3.embed_tokens.weight"], t["model.layers.3.shared_head.head.weight"]
    save_file(t, other + "/model.safetensors", metadata={"format": "pt"})
    m2 = dm.load(other, progress=False)
    assert m2.mtp[0].embed_tokens is m2.model.embed_tokens and m2.mtp[0].shared_head.head is m2.lm_head


def test_drafts_match_a_float64_recomputation(family):
    check_mtp_drafts(family[2], reference_mtp_drafts, 128)


def test_bad_mtp_layouts_are_refused(family, tmp_path):
    _, _, _, path = family
    wrong = str(tmp_path / "count")
    shutil.copytree(path, wrong)
    edit_config(wrong, num_nextn_predict_layers=2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        dm.load(wrong, progress=False)
    gap = str(tmp_path / "gap")
    shutil.copytree(path, gap)
    from safetensors.torch import load_file, save_file
    t = load_file(gap + "/model.safetensors")
    t = {k.replace("model.layers.3.", "model.layers.4."): v for k, v in t.items()}
    save_file(t, gap + "/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="without a gap"):
        dm.load(gap, progress=False)
    missing = str(tmp_path / "missing")
    shutil.copytree(path, missing)
    t = load_file(missing + "/model.safetensors")
    del t["model.layers.3.enorm.weight"]
    save_file(t, missing + "/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.enorm\.weight"):
        dm.load(missing, progress=False)


def test_layers_past_the_decoder_without_a_head_are_logged(family, tmp_path, caplog):
    """Tensors of a layer past num_hidden_layers that makes no head (no eh_proj: not an MTP layer this model
    runs) are left unread and said so, by count and layer -- not dropped silently."""
    import logging

    from safetensors.torch import load_file, save_file

    name, plain, _, path = family
    other = str(tmp_path / "partial")
    shutil.copytree(path, other)
    t = load_file(other + "/model.safetensors")
    del t["model.layers.3.eh_proj.weight"]
    left = sum(k.startswith("model.layers.3.") for k in t)
    save_file(t, other + "/model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        model = dm.load(other, progress=False)
    assert not model.has_mtp
    assert f"not loading {left} tensors of the multi-token-prediction layers model.layers.[3]" in caplog.text
