"""``dynamoe.models.load(path, group=...)``: expert-parallel loading. Each of W ranks holds E/W routed experts
(rank r: experts [r*E/W, (r+1)*E/W)) and reads only theirs, for per-expert (Qwen3-MoE) and stacked
(GPT-OSS fused) layouts, dense and quantized; logits equal the one-process model's. Plus the pieces that
need no process group: reading a range of experts, and the stacked-tensor view with its clear error."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_, save_tiny

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.cli import quantize_checkpoint  # noqa: E402
from dynamoe.models.weights import ExpertRows, FusedInterleaved, PerExpert, read_experts  # noqa: E402
from dynamoe.quant import QuantizedExperts, QuantizedWeight  # noqa: E402
from dynamoe.quant.checkpoint import quant_config_from_dir  # noqa: E402
from dynamoe.quant.checkpoint_files import CheckpointTensors  # noqa: E402

IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def qwen3(num_experts=4, moe_intermediate=32):
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      moe_intermediate_size=moe_intermediate, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=num_experts, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=256, mlp_only_layers=[1])
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    randomize_(hf, seed=1)
    return hf


def gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    randomize_(hf, seed=3, scales={"experts.gate_up_proj": 0.3, "experts.down_proj": 0.05, "sinks": 1.0})
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> folder: dense per-expert and fused layouts, and packed experts of both."""
    root = tmp_path_factory.mktemp("ep_load")
    dirs = {"qwen3": save_tiny(qwen3(), root / "qwen3"), "gpt_oss": save_tiny(gpt_oss(), root / "gpt_oss"),
            "qwen3_e3": save_tiny(qwen3(num_experts=3), root / "qwen3_e3")}
    for src, fmt, name in (("qwen3", "mxfp4", "qwen3_mxfp4"), ("gpt_oss", "mxfp4", "gpt_oss_mxfp4"),
                           ("qwen3", "nvfp4-modelopt", "qwen3_nvfp4"), ("qwen3", "int4-ct", "qwen3_int4")):
        dirs[name] = str(root / name)
        quantize_checkpoint(dirs[src], dirs[name], fmt, log=lambda *a: None)
    fp8_src = save_tiny(qwen3(moe_intermediate=128), root / "qwen3_f128")   # F = one FP8 block: packed experts
    dirs["qwen3_fp8"] = str(root / "qwen3_fp8")
    quantize_checkpoint(fp8_src, dirs["qwen3_fp8"], "fp8", log=lambda *a: None)
    return dirs


# ------------------------------------------------------------------------------------ no process group
def test_read_experts_range_equals_slice_of_all(checkpoints):
    for name, prefix, layout, E, F, bias in (("qwen3", "model.layers.0.mlp.experts", PerExpert(), 4, 32, False),
                                             ("gpt_oss", "model.layers.0.mlp.experts", FusedInterleaved(), 4, 64, True)):
        tensors = CheckpointTensors(checkpoints[name])
        full = read_experts(tensors, None, prefix, layout, E, F, 64, torch.float32, "cpu", bias=bias)
        for local in (range(0, 2), range(2, 4), range(1, 2)):
            part = read_experts(tensors, None, prefix, layout, E, F, 64, torch.float32, "cpu", bias=bias, local=local)
            for field in ("w1", "w2", "b1", "b2"):
                a, b = getattr(part, field), getattr(full, field)
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a, b[local.start:local.stop]), (name, field, local)
        with pytest.raises(ValueError, match="contiguous range"):
            read_experts(tensors, None, prefix, layout, E, F, 64, torch.float32, "cpu", bias=bias, local=range(0, 4, 2))


def test_packed_fused_range(checkpoints):
    """GPT-OSS MXFP4: the stacked packed tensors are read row range only, still packed."""
    path = checkpoints["gpt_oss_mxfp4"]
    tensors, qcfg = CheckpointTensors(path), quant_config_from_dir(path)
    args = (tensors, qcfg, "model.layers.1.mlp.experts", FusedInterleaved(), 4, 64, 64, torch.float32, "cpu")
    full = read_experts(*args, bias=True)
    part = read_experts(*args, bias=True, local=range(2, 4))
    assert isinstance(part.w1, QuantizedWeight) and part.w1.shape[0] == 2
    for field in ("w1", "w2"):
        torch.testing.assert_close(getattr(part, field).dequantize(torch.float32),
                                   getattr(full, field).dequantize(torch.float32)[2:4], atol=0, rtol=0)
    assert torch.equal(part.b1, full.b1[2:4]) and torch.equal(part.b2, full.b2[2:4])


def test_expert_rows_view():
    stacked, shared, odd = torch.arange(24.).view(4, 6), torch.tensor(2.0), torch.zeros(3, 4)
    rows = ExpertRows({"s": stacked, "g": shared, "x": odd}, range(1, 3), 4)
    assert torch.equal(rows["s"], stacked[1:3]) and rows["s"].untyped_storage().size() < stacked.untyped_storage().size()
    assert torch.equal(rows["g"], shared)
    assert "s" in rows and "y" not in rows and len(rows) == 3
    with pytest.raises(ValueError, match=r"tensor 'x' of shape \(3, 4\) cannot be split by expert.*num_experts=4"):
        rows["x"]


def test_group_needs_initialised_distributed(checkpoints):
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        dm.load(checkpoints["qwen3"], progress=False, group=object())


# ------------------------------------------------------------------------------------ 2 gloo ranks
def _experts_of(model):
    return [block.moe.experts for _, block in model.moe_layers()]


def ep_worker(rank, world, dirs):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    for name in ("qwen3", "gpt_oss", "qwen3_mxfp4", "gpt_oss_mxfp4", "qwen3_nvfp4", "qwen3_fp8", "qwen3_int4"):
        ref = dm.load(dirs[name], progress=False)
        ep = dm.load(dirs[name], progress=False, group=group)
        E = ref.config.num_experts
        L = E // world
        for (_, rb), (_, eb) in zip(ref.moe_layers(), ep.moe_layers()):
            assert eb.local_experts == range(rank * L, (rank + 1) * L)
            assert eb.moe.num_local_experts == L and eb.moe.num_global_experts == E and eb.moe.world_size == world
            re, ee = rb.moe.experts, eb.moe.experts
            assert type(re) is type(ee)
            if isinstance(ee, QuantizedExperts):
                assert ee.w1.shape[0] == L
                got, want = ee.w1.dequantize(torch.float32), re.w1.dequantize(torch.float32)[rank * L:(rank + 1) * L]
            else:
                assert ee.gate_up_proj.shape[0] == L
                got, want = ee.gate_up_proj, re.gate_up_proj[rank * L:(rank + 1) * L]
            assert torch.equal(got, want), name
            # the router and everything else is whole on every rank
            for (pn, p), (_, q) in zip(rb.moe.gates.named_parameters(), eb.moe.gates.named_parameters()):
                assert torch.equal(p, q), (name, pn)
        assert torch.equal(ref.model.embed_tokens.weight, ep.model.embed_tokens.weight)
        with torch.no_grad():
            want, got = ref(IDS), ep(IDS)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
            # cached prefill + decode steps too (decode-sized batches take other expert paths)
            cache = ep.new_cache(2, 16)
            steps = [ep(IDS[:, :9], cache=cache)] + [ep(IDS[:, t:t + 1], cache=cache) for t in range(9, 12)]
            # (the decode kernels sum in another order than the prefill's matmuls: 8-, 16-lane or scalar partial
            # sums by build; gpt_oss's fp32 logits, up to ~6, end ~1e-5 apart -- tests/test_models_attn_decode.py)
            torch.testing.assert_close(torch.cat(steps, 1), want, atol=3e-5, rtol=0, msg=name)
        # ranks with different batches still pair their exchanges (each gets its own rows' logits)
        with torch.no_grad():
            rows = IDS[:1, :5] if rank == 0 else IDS
            torch.testing.assert_close(ep(rows), ref(rows), atol=1e-5, rtol=0, msg=name)
    try:
        dm.load(dirs["qwen3_e3"], progress=False, group=group)
    except ValueError as err:
        assert "num_experts=3" in str(err) and "world size 2" in str(err), err
    else:
        raise AssertionError("3 experts over 2 ranks loaded")


def test_expert_parallel_load_matches_one_process(checkpoints):
    run_ranks(2, ep_worker, checkpoints, timeout=300)


def split_worker(rank, world, dirs):
    """Replicated tokens (multi-rank serving): a large batch is split over the ranks and gathered; the
    logits and every layer's routing statistics are the whole batch's, as in one process."""
    torch.set_num_threads(1)
    for name in ("qwen3", "gpt_oss_mxfp4"):
        ref = dm.load(dirs[name], progress=False)
        ep = dm.load(dirs[name], progress=False, group=dist.group.WORLD)
        calls = []
        for _, block in ep.moe_layers():
            block.replicated_tokens_()
            block.split_min_rows_per_rank = 5
            real = block._forward_split
            block._forward_split = lambda x, W, real=real: calls.append(x.shape) or real(x, W)
        with torch.no_grad():
            for ids in (IDS, IDS[:, :5], IDS[:1, :9]):   # 24 rows (split 12/12), 10 (split 5/5), 9 (not split)
                want, got = ref(ids), ep(ids)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
                for (_, rb), (_, eb) in zip(ref.moe_layers(), ep.moe_layers()):
                    assert torch.equal(eb.last_stats.load, rb.last_stats.load), name
                    assert torch.equal(eb.last_stats.kept, rb.last_stats.kept) and eb.last_stats.dropped == 0
        assert len(calls) == 2 * len(list(ep.moe_layers())), calls


def test_replicated_tokens_split_over_ranks(checkpoints):
    run_ranks(2, split_worker, checkpoints, timeout=300)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "int4"])
def test_packed_experts_take_source_blocks(fmt):
    """What the expert-parallel exchange hands a rank's L packed experts: W source blocks of L groups
    (group g -> expert g % L), equal to each block computed on its own, with and without autograd."""
    from dynamoe.quant import quantize, quantized_grouped_mm

    g = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(2, 128, 64, generator=g), fmt)
    b = torch.randn(2, 128, generator=g)
    counts = [3, 0, 2, 5]                           # 2 source blocks of 2 experts
    x = torch.randn(sum(counts), 64, generator=g)
    want = torch.cat([quantized_grouped_mm(x[:3], w, [3, 0], b), quantized_grouped_mm(x[3:], w, [2, 5], b)])
    with torch.no_grad():
        torch.testing.assert_close(quantized_grouped_mm(x, w, counts, b), want)
    xg = x.clone().requires_grad_()
    torch.testing.assert_close(quantized_grouped_mm(xg, w, counts, b), want)
    with pytest.raises(ValueError, match="or a multiple of E"):
        quantized_grouped_mm(x, w, [3, 0, 7], b)
