"""dynamoe against llama.cpp on the same weights: prefill and decode of the 490M Qwen3-MoE of
benchmarks/decode.py on CPU, batch 1, 2 threads, both engines in one run.

    python benchmarks/llama_cpp.py [--rounds 5] [--formats NAME ...] [--prompts 128 2048] [--new 64]
                                   [--llama-cpp-dir DIR] [--keep DIR]
    python benchmarks/llama_cpp.py --report DIR/results.json [...]

llama.cpp comes from the source package of llama-cpp-python on PyPI (pinned: LLAMA_CPP_PYTHON below), whose
vendor/llama.cpp is built outside the repository, under ~/.cache/dynamoe-bench (cmake, Release,
-DGGML_NATIVE=ON, static, only llama-bench, llama-quantize and libllama; cached: a rerun skips the build).
``--llama-cpp-dir`` points at another llama.cpp source tree instead. Needs cmake and a C++ compiler.

The model: benchmarks/decode.py's CONFIG and build_checkpoint (random weights, seed 0), rounded once to bf16
and saved as safetensors. From that one folder:

* llama.cpp: vendor/llama.cpp/convert_hf_to_gguf.py (with its own gguf-py) writes the bf16 GGUF -- a random
  model has no tokenizer, so the vocabulary is written as tokenizer model "none" with vocab_size dummy tokens,
  which llama.cpp accepts -- then llama-quantize makes Q8_0, Q4_0 (its standard mixes: Q4_0 keeps the output
  matrix in Q6_K) and MXFP4_MOE with everything but the routed experts kept bf16, the bytes of dynamoe's mxfp4.
* dynamoe: ``dynamoe quantize`` (dynamoe.cli.quantize_checkpoint) makes fp8, mxfp4, nvfp4-modelopt and int4-ct;
  the 4-bit formats also run with int8 activations (``act_quant='int8'`` on every packed module, "+int8").

Before timing, the conversion is checked: the logits of a 16-token prompt from llama.cpp (a small C++ program
built against the same libllama, tokens in, logits out) and from dynamoe are compared with transformers' fp32
forward of the same bf16 weights; bf16 GGUF logits must match (relative RMS error < 5%, same argmax at most
positions) or the script stops. The table shows this error for every format: what each quantization costs.

Timing, interleaved: every round runs every format once, the order rotated each round; the tables show the
median and the best over rounds (least ms, most tok/s: on a shared machine other jobs only ever add time).
``--keep DIR`` also saves DIR/results.json; ``--report FILE ...`` prints the tables again from such files, their
rounds pooled. One round takes ~80 s on a quiet 2-vCPU VM, the setup (conversions, quantization) a few minutes.
* llama.cpp: ``llama-bench -t 2 -p P1,P2 -n NEW -r 1 -o json`` (its own warm-up run first), pp and tg tok/s.
* dynamoe: torch.set_num_threads(2); decode.py's time_dynamoe: prefill = a P-token prompt in a fresh cache to
  the first token's logits; decode ms/token = NEW single-token steps from position 1 (as llama-bench's tg, which
  decodes NEW tokens from an empty cache), greedy. Each model gets one warm-up pass after loading.
* MB/token: the bytes a decode step reads, from the weight files: every tensor once, the routed experts'
  tensors x top_k / num_experts, the embedding table x 1 / vocab (the KV cache is negligible here).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import decode  # noqa: E402  (benchmarks/decode.py: the model and its timing)

LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI source package whose vendor/llama.cpp is benchmarked
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dynamoe-bench")
THREADS = 2
CHECK_TOKENS, CHECK_NEW = 16, 8

# name -> (engine, how it is made): llama.cpp: llama-quantize type (None: the converter's bf16) and extra
# arguments; dynamoe: `dynamoe quantize` format[:modules] (None: bf16 as saved) and act_quant. "+head": the
# attention and the head packed too (`--modules`), as llama.cpp's Q4_0 / Q8_0 pack every matrix
FORMATS = {
    "llama.cpp:bf16": ("llama.cpp", None, ()),
    "llama.cpp:q8_0": ("llama.cpp", "Q8_0", ()),
    "llama.cpp:q4_0": ("llama.cpp", "Q4_0", ()),
    "llama.cpp:mxfp4_moe": ("llama.cpp", "MXFP4_MOE", ("--tensor-type", "attn_=bf16", "--output-tensor-type", "bf16",
                                                        "--token-embedding-type", "bf16")),
    "dynamoe:bf16": ("dynamoe", None, None),
    "dynamoe:fp8": ("dynamoe", "fp8", None),
    "dynamoe:mxfp4": ("dynamoe", "mxfp4", None),
    "dynamoe:mxfp4+int8": ("dynamoe", "mxfp4", "int8"),
    "dynamoe:nvfp4": ("dynamoe", "nvfp4-modelopt", None),
    "dynamoe:nvfp4+int8": ("dynamoe", "nvfp4-modelopt", "int8"),
    "dynamoe:int4": ("dynamoe", "int4-ct", None),
    "dynamoe:int4+int8": ("dynamoe", "int4-ct", "int8"),
    "dynamoe:mxfp4+head": ("dynamoe", "mxfp4:experts,attention,mlp,lm_head", None),
    "dynamoe:nvfp4+head": ("dynamoe", "nvfp4-modelopt:experts,attention,mlp,lm_head", None),
    "dynamoe:int4+head": ("dynamoe", "int4-ct:experts,attention,mlp,lm_head", None),
    "dynamoe:fp8+head": ("dynamoe", "fp8:experts,attention,mlp,lm_head", None),
}
# the targets: (dynamoe formats, llama.cpp reference, decode ms ratio <=, prefill tok/s ratio >=)
TARGETS = [
    (("dynamoe:mxfp4", "dynamoe:mxfp4+int8", "dynamoe:nvfp4", "dynamoe:nvfp4+int8", "dynamoe:int4",
      "dynamoe:int4+int8", "dynamoe:mxfp4+head", "dynamoe:nvfp4+head", "dynamoe:int4+head"), "llama.cpp:q4_0", 0.8, 2.0),
    (("dynamoe:fp8", "dynamoe:fp8+head"), "llama.cpp:q8_0", 0.8, 2.0),
    (("dynamoe:bf16",), "llama.cpp:bf16", 1.0, 1.0),
    (("dynamoe:mxfp4", "dynamoe:mxfp4+int8"), "llama.cpp:mxfp4_moe", None, None),  # identical bytes: no target
]

DUMP_LOGITS_CPP = r"""
// tokens in, logits out: evaluates a prompt in one batch (logits of every position), then NEW greedy steps.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int argmax(const float * x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc != 6) { fprintf(stderr, "usage: %s MODEL.gguf TOKENS.i32 NEW THREADS OUT.f32\n", argv[0]); return 2; }
    std::vector<llama_token> tokens;
    FILE * f = fopen(argv[2], "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", argv[2]); return 2; }
    for (int t; fread(&t, sizeof t, 1, f) == 1;) tokens.push_back(t);
    fclose(f);
    const int n_new = atoi(argv[3]), n_threads = atoi(argv[4]), n = (int) tokens.size();
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + n_new + 16; cp.n_batch = n; cp.n_ubatch = n;
    cp.n_threads = n_threads; cp.n_threads_batch = n_threads; cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    FILE * out = fopen(argv[5], "wb");
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    int tok = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
    std::vector<int> gen;
    for (int g = 0; g < n_new; g++) {
        gen.push_back(tok);
        if (g == n_new - 1) break;
        batch.n_tokens = 1; batch.token[0] = tok; batch.pos[0] = n + g; batch.logits[0] = 1;
        if (llama_decode(ctx, batch)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        tok = argmax(llama_get_logits_ith(ctx, 0), n_vocab);
    }
    fwrite(gen.data(), sizeof(int), gen.size(), out);
    fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure show its output's tail and stop."""
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-30:])
        sys.exit(f"error: {' '.join(map(str, cmd[:4]))} ... failed (exit {res.returncode}):\n{tail}")
    return res


# ---- llama.cpp: source, build ----

def build_tools() -> dict:
    """cmake, ninja (optional) and a C++ compiler, or a clear exit naming what is missing."""
    tools = {"cmake": shutil.which("cmake"), "ninja": shutil.which("ninja")}
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    missing = [n for n, v in (("cmake", tools["cmake"]), ("a C++ compiler (c++/g++/clang++ or $CXX)", cxx),
                              ("a C compiler (cc/gcc/clang or $CC)", cc)) if not v]
    if missing:
        sys.exit(f"error: building llama.cpp needs {' and '.join(missing)}, not found on PATH "
                 f"(e.g. apt-get install cmake g++ ninja-build)")
    tools.update(cxx=cxx, cc=cc)
    return tools


def llama_cpp_source(version: str) -> str:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded (pip) and unpacked under CACHE once."""
    root = os.path.join(CACHE, f"llama_cpp_python-{version}")
    src = os.path.join(root, "vendor", "llama.cpp")
    if os.path.exists(os.path.join(src, "CMakeLists.txt")):
        return src
    os.makedirs(CACHE, exist_ok=True)
    sdist = os.path.join(CACHE, f"llama_cpp_python-{version}.tar.gz")
    if not os.path.exists(sdist):
        log(f"downloading the llama-cpp-python=={version} source package into {CACHE}")
        run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
             "--no-deps", "-d", CACHE])
    with tarfile.open(sdist) as tar:
        tar.extractall(CACHE, filter="data")
    if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
        sys.exit(f"error: {sdist} has no vendor/llama.cpp")
    return src


def build_llama_cpp(src: str) -> dict:
    """Build llama-bench, llama-quantize and the logits dumper (cached per source tree); their paths."""
    tag = os.path.basename(os.path.dirname(os.path.dirname(src))) if "vendor" in src else os.path.basename(src)
    build = os.path.join(CACHE, f"build-{tag.replace('llama_cpp_python-', '')}")
    bins = {name: os.path.join(build, "bin", name) for name in ("llama-bench", "llama-quantize")}
    bins["dump-logits"] = os.path.join(build, "dump-logits")
    if all(os.path.exists(b) for b in bins.values()):
        return bins
    tools = build_tools()
    if not all(os.path.exists(b) for b in list(bins.values())[:2]):
        gen = ["-G", "Ninja"] if tools["ninja"] else []
        log(f"building llama.cpp from {src} into {build} (cmake, 2 jobs; several minutes on 2 cores)")
        run([tools["cmake"], "-S", src, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             f"-DCMAKE_C_COMPILER={tools['cc']}", f"-DCMAKE_CXX_COMPILER={tools['cxx']}"])
        run([tools["cmake"], "--build", build, "--target", "llama-bench", "llama-quantize", "llama", "-j2"])
    cpp = os.path.join(build, "dump-logits.cpp")
    with open(cpp, "w") as f:
        f.write(DUMP_LOGITS_CPP)
    libs = sorted(glob.glob(os.path.join(build, "src", "libllama.a")) + glob.glob(os.path.join(build, "ggml", "src", "**", "*.a"),
                                                                                 recursive=True))
    cache = open(os.path.join(build, "CMakeCache.txt")).read()
    omp = ["-fopenmp"] if "GGML_OPENMP_ENABLED:INTERNAL=ON" in cache else []
    run([tools["cxx"], "-O2", "-std=c++17", cpp, "-I", os.path.join(src, "include"), "-I", os.path.join(src, "ggml", "include"),
         "-Wl,--start-group", *libs, "-Wl,--end-group", *omp, "-lpthread", "-ldl", "-lm", "-o", bins["dump-logits"]])
    return bins


# ---- the weights in both engines ----

def make_checkpoint(folder: str) -> None:
    """decode.py's checkpoint (fp32, seed 0) rounded once to bf16: the one source of every format."""
    from safetensors.torch import load_file, save_file

    decode.build_checkpoint(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def convert_script(module: str, cls: str) -> str:
    """A ``python -c`` script: llama.cpp's convert_hf_to_gguf.py on a checkpoint of converter class ``module.cls``
    without a tokenizer (arguments: the llama.cpp source, the checkpoint folder, the output GGUF)."""
    return rf"""
import sys
src, hf, out = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import convert_hf_to_gguf as convert
from {module} import {cls}

def set_vocab(self):  # a random model has no tokenizer: no vocabulary, vocab_size dummy tokens
    self._set_vocab_none()
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

{cls}.set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", "bf16", "--outfile", out]
convert.main()
"""


CONVERT = convert_script("conversion.qwen", "Qwen3MoeModel")


def make_gguf(src: str, bins: dict, hf: str, work: str, name: str) -> str:
    path = os.path.join(work, f"{name.split(':')[1]}.gguf")
    if os.path.exists(path):
        return path
    _, qtype, extra = FORMATS[name]
    if qtype is None:
        log("converting the checkpoint to GGUF bf16 (convert_hf_to_gguf.py)")
        run([sys.executable, "-c", CONVERT, src, hf, path + ".tmp"])
    else:
        base = make_gguf(src, bins, hf, work, "llama.cpp:bf16")
        log(f"llama-quantize {qtype} {' '.join(extra)}")
        run([bins["llama-quantize"], *extra, base, path + ".tmp", qtype, str(THREADS)])
    os.replace(path + ".tmp", path)
    return path


def make_dynamoe(hf: str, work: str, fmt: str | None) -> str:
    if fmt is None:
        return hf
    path = os.path.join(work, "dynamoe-" + fmt.replace(":", "-").replace(",", "-"))
    if not os.path.exists(os.path.join(path, "config.json")):
        from dynamoe.cli import quantize_checkpoint

        shutil.rmtree(path, ignore_errors=True)
        base, _, modules = fmt.partition(":")
        quantize_checkpoint(hf, path, base, log=log, modules=frozenset(modules.split(",")) if modules else None)
    return path


def load_dynamoe(path: str, act_quant: str | None):
    import dynamoe.models
    from dynamoe.ops.linear_decode import INT8_ACT_FORMATS
    from dynamoe.quant.act_quant import act_quant_of
    from dynamoe.quant.modules import QuantizedExperts, QuantizedLinear

    model = dynamoe.models.load(path, dtype=torch.bfloat16, progress=False)
    if act_quant is not None:  # before the first forward: the decode plan is built from the modules as they are
        n = 0
        for m in model.modules():
            if isinstance(m, (QuantizedExperts, QuantizedLinear)) and m.format in INT8_ACT_FORMATS:
                m.act_quant = act_quant_of(act_quant)
                n += 1
        if not n:
            sys.exit(f"error: {path} has no packed module in {INT8_ACT_FORMATS} for act_quant={act_quant!r}")
    return model


def mb_per_token_gguf(path: str, src: str) -> float:
    sys.path.insert(0, os.path.join(src, "gguf-py"))
    from gguf import GGUFReader

    k, e, v = decode.CONFIG["num_experts_per_tok"], decode.CONFIG["num_experts"], decode.CONFIG["vocab_size"]
    total = 0.0
    for t in GGUFReader(path).tensors:
        share = k / e if "_exps" in t.name else 1 / v if t.name.startswith("token_embd") else 1.0
        total += int(t.n_bytes) * share
    return total / 1e6


def mb_per_token_safetensors(folder: str) -> float:
    from safetensors import safe_open

    k, e, v = decode.CONFIG["num_experts_per_tok"], decode.CONFIG["num_experts"], decode.CONFIG["vocab_size"]
    total = 0.0
    for file in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = 1
                for s in t.get_shape():
                    n *= s
                nbytes = n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4,
                              "F8_E8M0": 1}.get(t.get_dtype(), 4)
                share = k / e if ".experts." in name else 1 / v if "embed_tokens" in name else 1.0
                total += nbytes * share
    return total / 1e6


# ---- the conversion check ----

def reference_logits(hf: str, prompt: torch.Tensor, new: int):
    """transformers, fp32 compute on the bf16 weights: (logits [T, V], greedy tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(prompt).logits[0].float()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return logits, out[0, prompt.size(1):].tolist()


def dynamoe_logits(model, prompt: torch.Tensor, new: int):
    cache = model.new_cache(1, prompt.size(1) + new)
    with torch.inference_mode():
        logits = model(prompt, cache=cache)[0].float()
        toks = [int(logits[-1].argmax())]
        for _ in range(new - 1):
            toks.append(int(model(torch.tensor([[toks[-1]]]), cache=cache)[0, -1].float().argmax()))
    return logits, toks


def llama_logits(bins: dict, gguf: str, prompt: torch.Tensor, new: int, work: str):
    tok_file, out_file = os.path.join(work, "check-tokens.i32"), os.path.join(work, "check-logits.f32")
    prompt[0].to(torch.int32).numpy().tofile(tok_file)
    run([bins["dump-logits"], gguf, tok_file, str(new), str(THREADS), out_file])
    raw = torch.from_file(out_file, size=os.path.getsize(out_file) // 4, dtype=torch.float32)
    T, V = prompt.size(1), decode.CONFIG["vocab_size"]
    return raw[: T * V].reshape(T, V).clone(), raw[T * V:].view(torch.int32).tolist()


def compare(logits: torch.Tensor, toks: list, ref: tuple) -> dict:
    ref_logits, ref_toks = ref
    rel = float((logits - ref_logits).norm() / ref_logits.norm())
    top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    same = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(ref_toks))
    return {"rel_err": rel, "top1": top1, "greedy_same": same}


# ---- timing ----

def bench_llama(bins: dict, gguf: str, prompts: list, new: int) -> dict:
    res = run([bins["llama-bench"], "-m", gguf, "-t", str(THREADS), "-p", ",".join(map(str, prompts)), "-n", str(new),
               "-r", "1", "-o", "json"])
    out = {}
    for test in json.loads(res.stdout):
        if test["n_gen"] == 0:
            out[f"pp{test['n_prompt']}"] = test["avg_ts"]
        elif test["n_prompt"] == 0:
            out["decode_ms"] = 1e3 / test["avg_ts"]
        out.setdefault("info", {k: test.get(k) for k in ("build_commit", "cpu_info", "n_batch", "n_ubatch",
                                                       "flash_attn", "type_k", "type_v", "model_type")})
    return out


def bench_dynamoe(model, prompts: list, new: int, tokens: torch.Tensor) -> dict:
    out = {}
    for p in prompts:
        pre, _, _ = decode.time_dynamoe(model, tokens[:, :p], 1)
        out[f"pp{p}"] = p / pre
    pre, total, _ = decode.time_dynamoe(model, tokens[:, :1], new + 1)  # NEW steps from position 1
    out["decode_ms"] = (total - pre) / new * 1e3
    return out


def summarize(runs: list, stat: str) -> dict:
    """One number per measure over rounds: the median, or the best (least ms, most tok/s: on a shared machine
    the other jobs only ever add time)."""
    if stat == "median":
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {k: (min if k == "decode_ms" else max)(r[k] for r in runs) for k in runs[0]}


def report(results: dict, mb: dict, check: dict, prompts: list, stat: str) -> None:
    """The table of every format and the ratios against the issue's targets, for ``stat`` over rounds."""
    s = {name: summarize(runs, stat) for name, runs in results.items()}
    pp = [f"pp{p}" for p in prompts]
    head = (f"| engine:format ({stat} of {len(next(iter(results.values())))} rounds) | MB/token | "
            f"{' | '.join(f'prefill tok/s @{p}' for p in prompts)} | decode ms/token | logits rel. err | argmax agrees |")
    print("\n" + head)
    print("| --- " * (head.count("|") - 1) + "|")
    for name, m in s.items():
        c = check[name]
        print(f"| {name} | {mb[name]:.0f} | {' | '.join(f'{m[k]:.0f}' for k in pp)} | {m['decode_ms']:.2f} | "
              f"{c['rel_err']:.3f} | {c['top1']:.0%} |")
    print(f"\n| dynamoe vs llama.cpp ({stat}) | decode ms ratio (target) | "
          + " | ".join(f"prefill @{p} ratio (target)" for p in prompts) + " |")
    print("| --- " * (2 + len(prompts)) + "|")
    for ours, theirs, dec_t, pre_t in TARGETS:
        if theirs not in s:
            continue
        for name in ours:
            if name not in s:
                continue
            d = s[name]["decode_ms"] / s[theirs]["decode_ms"]
            cells = [f"{d:.2f}" + ("" if dec_t is None else f" ({'<' if dec_t == 1.0 else '<='} {dec_t}: "
                                                            f"{'yes' if (d < dec_t if dec_t == 1.0 else d <= dec_t) else 'no'})")]
            for k in pp:
                q = s[name][k] / s[theirs][k]
                cells.append(f"{q:.2f}" + ("" if pre_t is None else f" ({'>' if pre_t == 1.0 else '>='} {pre_t}: "
                                                                    f"{'yes' if (q > pre_t if pre_t == 1.0 else q >= pre_t) else 'no'})"))
            print(f"| {name} vs {theirs.split(':')[1]} | " + " | ".join(cells) + " |")


def report_files(paths: list) -> None:
    """--report: the tables again from the results.json of earlier --keep runs, their rounds pooled."""
    results: dict = {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        for name, runs in saved["rounds"].items():
            results.setdefault(name, []).extend(runs)
    prompts = saved.get("prompts") or sorted(int(k[2:]) for k in next(iter(results.values()))[0] if k.startswith("pp"))
    print(f"# {len(paths)} file(s): {', '.join(paths)}")
    for stat in ("median", "best"):
        report(results, saved["mb_per_token"], saved["check"], prompts, stat)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), metavar="NAME",
                   help=f"engine:format names, from {', '.join(FORMATS)} (default: all)")
    p.add_argument("--prompts", type=int, nargs="+", default=[128, 2048], help="prefill lengths (default 128 2048)")
    p.add_argument("--new", type=int, default=64, help="decode steps timed (default 64)")
    p.add_argument("--llama-cpp-dir", metavar="DIR",
                   help=f"a llama.cpp source tree (default: vendor/llama.cpp of llama-cpp-python=={LLAMA_CPP_PYTHON})")
    p.add_argument("--keep", metavar="DIR", help="work folder kept (and reused: checkpoints, GGUFs) instead of a temporary one")
    p.add_argument("--report", nargs="+", metavar="FILE",
                   help="only print the tables from the results.json of earlier --keep runs (rounds pooled)")
    args = p.parse_args(argv)
    if args.report:
        return report_files(args.report)
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        p.error(f"--formats: unknown {bad}; allowed: {', '.join(FORMATS)}")
    if args.rounds < 1 or args.new < 2 or min(args.prompts) < 1:
        p.error("--rounds >= 1, --new >= 2 and --prompts >= 1 are needed")
    if max(args.prompts) + args.new + 1 > decode.CONFIG["max_position_embeddings"]:
        p.error(f"--prompts + --new must fit in {decode.CONFIG['max_position_embeddings']} positions")
    if args.llama_cpp_dir and not os.path.exists(os.path.join(args.llama_cpp_dir, "CMakeLists.txt")):
        p.error(f"--llama-cpp-dir {args.llama_cpp_dir!r} has no CMakeLists.txt (expected a llama.cpp source tree)")
    torch.set_num_threads(THREADS)

    src = os.path.abspath(args.llama_cpp_dir) if args.llama_cpp_dir else llama_cpp_source(LLAMA_CPP_PYTHON)
    bins = build_llama_cpp(src)
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="dynamoe-llama-cpp-")
    work = os.path.abspath(args.keep) if args.keep else tmp.name
    os.makedirs(work, exist_ok=True)
    try:
        hf = os.path.join(work, "bf16")
        if not os.path.exists(os.path.join(hf, "model.safetensors")):
            log("building the checkpoint (benchmarks/decode.py CONFIG, seed 0, bf16)")
            make_checkpoint(hf)
        formats = [f for f in FORMATS if f in args.formats]
        if "llama.cpp:bf16" not in formats:  # the conversion check always runs on the bf16 GGUF
            formats_check = ["llama.cpp:bf16", *formats]
        else:
            formats_check = formats
        paths, mb, models = {}, {}, {}
        for name in formats_check:
            engine, fmt, act = FORMATS[name]
            if engine == "llama.cpp":
                paths[name] = make_gguf(src, bins, hf, work, name)
                mb[name] = mb_per_token_gguf(paths[name], src)
            else:
                paths[name] = make_dynamoe(hf, work, fmt)
                mb[name] = mb_per_token_safetensors(paths[name])

        log("checking the conversion: logits of a 16-token prompt against transformers fp32")
        prompt = torch.randint(0, decode.CONFIG["vocab_size"], (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(2))
        ref = reference_logits(hf, prompt, CHECK_NEW)
        check = {}
        for name in formats_check:
            engine, fmt, act = FORMATS[name]
            if engine == "llama.cpp":
                check[name] = compare(*llama_logits(bins, paths[name], prompt, CHECK_NEW, work), ref)
            else:
                models[name] = load_dynamoe(paths[name], act)
                check[name] = compare(*dynamoe_logits(models[name], prompt, CHECK_NEW), ref)
            c = check[name]
            log(f"  {name:22s} rel. RMS error {c['rel_err']:.4f}, argmax agrees at {c['top1']:.0%} of positions, "
                f"greedy tokens equal for {c['greedy_same']}/{CHECK_NEW}")
        c = check["llama.cpp:bf16"]
        if c["rel_err"] > 0.05 or c["top1"] < 0.75:
            sys.exit("error: llama.cpp's bf16 GGUF does not reproduce the checkpoint's logits: the conversion is wrong")

        tokens = torch.randint(0, decode.CONFIG["vocab_size"], (1, max(args.prompts)), generator=torch.Generator().manual_seed(1))
        for name in formats:  # warm-up: kernels, allocator, page cache
            if name in models:
                bench_dynamoe(models[name], args.prompts, 4, tokens)
        results = {name: [] for name in formats}
        bandwidth = []
        info = None
        for r in range(args.rounds):
            bandwidth.append(decode.read_bandwidth())
            order = formats[r % len(formats):] + formats[: r % len(formats)]
            for name in order:
                if FORMATS[name][0] == "llama.cpp":
                    res = bench_llama(bins, paths[name], args.prompts, args.new)
                    info = res.pop("info")
                else:
                    res = bench_dynamoe(models[name], args.prompts, args.new, tokens)
                results[name].append(res)
            log(f"round {r + 1}/{args.rounds} done (read bandwidth {bandwidth[-1] / 1e9:.1f} GB/s)")
    finally:
        if tmp is not None:
            tmp.cleanup()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\n# {cpu}, {os.cpu_count()} CPUs, {THREADS} threads, torch {torch.__version__}, "
          f"llama.cpp {info and info.get('build_commit')} (llama-cpp-python {LLAMA_CPP_PYTHON}"
          f"{'' if not args.llama_cpp_dir else ', ' + args.llama_cpp_dir})")
    if info:
        print(f"# llama-bench: n_batch {info['n_batch']}, n_ubatch {info['n_ubatch']}, flash_attn {info['flash_attn']}")
    print(f"# {args.rounds} rounds; read bandwidth per round: {', '.join(f'{b / 1e9:.1f}' for b in bandwidth)} GB/s")
    for stat in ("median", "best"):
        report(results, mb, check, args.prompts, stat)
    if args.keep:
        with open(os.path.join(work, "results.json"), "w") as f:
            json.dump({"rounds": results, "prompts": args.prompts, "check": check, "mb_per_token": mb,
                       "bandwidth": bandwidth, "llama_bench": info}, f, indent=1)


if __name__ == "__main__":
    main()
