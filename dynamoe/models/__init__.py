"""Model families on dynamoe's MoE layer: Qwen3-MoE, Mixtral, GPT-OSS, DeepSeek-V3 / Kimi-K2, GLM-4.5,
DeepSeek-V3.2, GLM-5, Qwen1.5/2-MoE, OLMoE, DeepSeek-V2, MiniMax-M2, GLM-4.7-Flash, dots.llm1, GraniteMoE(-Shared),
FlexOlmo, Hunyuan-A13B, ERNIE-4.5-MoE, K-EXAONE (more register through :mod:`dynamoe.models.registry`; the MoE
types that do not load say why: :mod:`dynamoe.models.unsupported`), the shared blocks they are
built from (GQA and MLA attention, the sparse-attention indexer, RoPE, the MoE block), and the
checkpoint loader.

``model = dynamoe.models.load(path, dtype=torch.bfloat16)`` reads a Hugging Face folder;
``model(input_ids, cache=model.new_cache(slots, max_len), slots=...)`` runs it.
"""
from .base import CausalLM, DecoderLayer, MoELayerStats
from .cache import KVCache
from .config import ModelConfig, RopeConfig
from .loader import load, load_config
from .registry import builder_for, family_for, register, supported_families

__all__ = ["load", "load_config", "ModelConfig", "RopeConfig", "KVCache", "CausalLM", "DecoderLayer", "MoELayerStats",
           "register", "family_for", "builder_for", "supported_families"]
