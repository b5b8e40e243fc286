"""Every MoE model_type of the installed transformers is either a registered dynamoe family or refused
with a reason (dynamoe.models.unsupported), and a refused one fails to load with a ValueError that
names it and says why -- before any field is parsed (a vision wrapper has no top-level hidden_size, a
hybrid's layer_types have kinds we do not know: those errors would mislead)."""
import inspect
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.registry import is_registered, supported_families  # noqa: E402
from dynamoe.models.unsupported import UNSUPPORTED  # noqa: E402

# the fields that hold a config's expert count, in the families transformers has
EXPERT_COUNT_FIELDS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}


def _fields(cls) -> set:
    """A configuration class's fields: dataclass-style annotations over its MRO and __init__'s parameters."""
    names = set()
    for c in cls.__mro__:
        names |= set(vars(c).get("__annotations__", {}))
    try:
        names |= set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    return names


def _is_moe(cls, depth: int = 0) -> bool:
    """An expert-count field in the class or in one of its sub-configs (DBRX's ffn_config, a vision
    wrapper's text_config); AutoConfig sub-configs (any model) do not count."""
    if _fields(cls) & EXPERT_COUNT_FIELDS:
        return True
    subs = getattr(cls, "sub_configs", None) or {}
    return depth < 3 and any(isinstance(s, type) and _is_moe(s, depth + 1) for s in subs.values())


def _default_sub_config_is_moe(cls) -> bool:
    """A wrapper whose sub-configs are any model (AutoConfig) but default to an MoE one (Kimi-K2.5's
    text_config is DeepSeek-V3 unless the file says otherwise)."""
    subs = getattr(cls, "sub_configs", None) or {}
    if not subs:
        return False
    try:
        cfg = cls()
    except Exception:  # noqa: BLE001 (a class that needs arguments has no default sub-configs to look at)
        return False
    return any(_is_moe(type(getattr(cfg, k, None))) for k in subs if getattr(cfg, k, None) is not None)


@pytest.fixture(scope="module")
def moe_types() -> dict:
    """model_type -> configuration class, for every MoE model_type transformers registers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # default configs warn about token ids outside their vocab
    try:
        return {mt: CONFIG_MAPPING[mt] for mt in CONFIG_MAPPING_NAMES
                if _is_moe(CONFIG_MAPPING[mt]) or _default_sub_config_is_moe(CONFIG_MAPPING[mt])}
    finally:
        transformers.logging.set_verbosity(verbosity)


def test_discovery_finds_known_families(moe_types):
    # plain (num_experts, num_local_experts, n_routed_experts), a sub-config (DBRX), a vision wrapper (Llama-4)
    # and a wrapper whose text_config defaults to an MoE model (Kimi-K2.5)
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "dbrx", "llama4", "llama4_text", "kimi_k25"} <= set(moe_types)
    assert "llama" not in moe_types and "llava" not in moe_types   # dense, and a wrapper of any model


def test_every_moe_model_type_is_supported_or_refused(moe_types):
    missing = sorted(mt for mt in moe_types if not is_registered(mt) and mt not in UNSUPPORTED)
    assert not missing, (f"MoE model types of transformers {transformers.__version__} that dynamoe neither "
                         f"registers nor refuses (add a family, or a reason to dynamoe/models/unsupported.py): {missing}")


def test_refusals_are_not_registered_and_say_why():
    assert not set(UNSUPPORTED) & set(supported_families())
    assert list(UNSUPPORTED) == sorted(UNSUPPORTED)
    for mt, reason in UNSUPPORTED.items():
        assert isinstance(reason, str) and len(reason) > 20, mt


def _default_config(cls, mt: str) -> dict:
    """The config.json transformers would save for ``mt`` with its defaults (or just the model_type
    where the class cannot be built without arguments)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        d = cls().to_dict()
    except Exception:  # noqa: BLE001 (some classes need arguments: the refusal must not need them)
        d = {}
    finally:
        transformers.logging.set_verbosity(verbosity)
    d["model_type"] = mt
    return d


def test_refused_types_raise_before_parsing(moe_types):
    """Each refused type, as transformers' defaults would save it, fails with "<model_type>: <reason>"."""
    for mt in sorted(set(moe_types) & set(UNSUPPORTED)):
        with pytest.raises(ValueError) as err:
            dm.ModelConfig.from_dict(_default_config(moe_types[mt], mt))
        assert str(err.value).startswith(f"{mt}: {UNSUPPORTED[mt]}"), str(err.value)


@pytest.mark.parametrize("mt,why", [
    ("diffusion_gemma", "wrapper"),                       # was: 'hidden_size' is required
    ("nllb-moe", "encoder-decoder"),                      # not a decoder-only model: would complain about its fields
    ("unlimited_ocr_text", "no causal LM with a head"),   # a base model: would parse, then miss lm_head
])
def test_load_names_the_refused_type(moe_types, mt, why, tmp_path):
    d = _default_config(moe_types[mt], mt)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f, default=str)
    save_file({"x": torch.zeros(1)}, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^{mt}: .*{why}.*\(model_type '{mt}' is not supported\)"):
        dm.load(tmp_path, progress=False)


def test_registering_a_refused_type_lifts_the_refusal():
    from dynamoe.models import registry

    d = {"model_type": "nllb-moe", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="^nllb-moe: "):
        dm.ModelConfig.from_dict(d)
    registry.register("nllb-moe", lambda cfg, dtype=None: None)
    try:
        assert dm.ModelConfig.from_dict(d).model_type == "nllb-moe"
    finally:
        registry._FAMILIES.pop("nllb-moe")
