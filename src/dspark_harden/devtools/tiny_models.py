"""Tiny local tokenizers and random-weight models (nothing is downloaded from a hub).

Stand-ins: these models have random bf16 weights; they exist so that the *unmodified*
``sglang.launch_server`` can load a real DeepseekV3 (MLA + MoE), Qwen3 or Llama architecture on a
CPU-only machine (see shared/design/cpu-e2e.md). Their outputs are meaningless but deterministic
under greedy sampling, which is all differential tests need.

- :func:`ensure_tokenizer` trains a byte-level BPE with ``tokenizers`` on the Python standard
  library sources found on disk (sorted file order, so the input is deterministic), adds the
  ChatML specials (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` = eos, ``<|pad|>``) and the
  reasoning markers ``<think>`` / ``</think>`` (ordinary added tokens, *not* special, so that
  ``skip_special_tokens`` keeps them for reasoning parsers), and saves it as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template.
- :func:`ensure_model` builds one of :data:`ARCHS` with the 2048-token tokenizer.

Everything is cached under ``$DSPARK_HARDEN_MODEL_CACHE`` (default
``~/.cache/dspark-harden/models``), built once per key, atomically: a temporary directory inside
the cache is filled and then renamed into place while holding a file lock, so parallel pytest
workers (or a demo and a test run) never see or build a half-written model.

CLI: ``python -m dspark_harden.devtools.tiny_models [--all | --arch A ...] [--vocab N ...]``
prints the resulting paths.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

#: bump when the build recipe changes, so stale caches are not reused
RECIPE_VERSION = 1

CACHE_ENV = "DSPARK_HARDEN_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/dspark-harden/models")

#: special tokens, in id order (ids 0..3)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
#: reasoning markers: single ids, not "special" (decoding with skip_special_tokens keeps them)
THINK_TOKENS = ("<think>", "</think>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|endoftext|>"

MODEL_VOCAB = 2048

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set content = '' -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | select('string') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Training corpus budget: enough text for a 32000-token vocabulary, small enough to train in
# seconds on 2 cores. A larger vocabulary (DeepSeek V3/V4's 129,280: ``bench grammar --vocab
# 129280``) needs more distinct words than the standard library holds (all of CPython 3.11's gives
# 115,394 tokens), so above 32000 tokens the corpus is the standard library followed by the
# interpreter's site-packages sources (sorted, so deterministic for one installation), up to
# _LARGE_CORPUS_MAX_BYTES. At or below 32000 the recipe, and so every cached tokenizer, is unchanged.
_CORPUS_MAX_BYTES = 10_000_000
_CORPUS_LARGE_VOCAB = 32000
_LARGE_CORPUS_MAX_BYTES = 80_000_000
_CORPUS_MAX_FILE = 200_000


def _corpus_budget(vocab_size: int) -> tuple[int, bool]:
    """(bytes of corpus, whether site-packages sources follow the standard library) for a
    ``vocab_size`` tokenizer."""
    if vocab_size <= _CORPUS_LARGE_VOCAB:
        return _CORPUS_MAX_BYTES, False
    return _LARGE_CORPUS_MAX_BYTES, True


def cache_dir() -> Path:
    raw = os.environ.get(CACHE_ENV, "")
    base = Path(raw) if raw.strip() else DEFAULT_CACHE
    base = base.expanduser().resolve()
    base.mkdir(parents=True, exist_ok=True)
    return base


def _build_once(name: str, build: Callable[[Path], None]) -> str:
    """Return ``cache_dir()/name``, building it with ``build(tmp_dir)`` exactly once (locked, atomic)."""
    from filelock import FileLock

    base = cache_dir()
    final = base / name
    marker = final / ".complete"
    if marker.is_file():
        return str(final)
    with FileLock(str(base / f".{name}.lock")):
        if marker.is_file():
            return str(final)
        if final.exists():  # a half-built leftover of a killed run (no marker): rebuild
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=base))
        try:
            build(tmp)
            (tmp / ".complete").write_text(json.dumps({"recipe": RECIPE_VERSION, "built_by_pid": os.getpid()}) + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(final)


# ---------------------------------------------------------------------------------------------
# tokenizer


def _corpus_files(max_bytes: int = _CORPUS_MAX_BYTES, site_packages: bool = False) -> list[Path]:
    """Python sources of the standard library (then, with ``site_packages``, of the interpreter's
    site-packages), sorted (deterministic order), within ``max_bytes``."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "platstdlib"):
        path = paths.get(key)
        if path and Path(path).is_dir() and Path(path) not in roots:
            roots.append(Path(path))
    if not roots:
        raise RuntimeError("no Python standard library sources found on disk to train the tokenizer on")
    extra = []
    if site_packages:
        for key in ("purelib", "platlib"):
            path = paths.get(key)
            if path and Path(path).is_dir() and Path(path) not in extra:
                extra.append(Path(path))
    files: list[Path] = []
    total = 0
    for root, skip in [(r, ("site-packages", "dist-packages", "__pycache__")) for r in roots] + [
        (r, ("__pycache__",)) for r in extra
    ]:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).parts
            if any(p in skip for p in rel):
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size == 0 or size > _CORPUS_MAX_FILE:
                continue
            files.append(path)
            total += size
            if total >= max_bytes:
                return files
    return files


def _corpus_iter(files: list[Path]):
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # Some chat-like text so the specials' neighbourhoods are in the corpus.
        yield text


def _build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = len(THINK_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = _corpus_files(*_corpus_budget(vocab_size))
    tok.train_from_iterator(_corpus_iter(files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=PAD_TOKEN,
        additional_special_tokens=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(list(THINK_TOKENS), special_tokens=False)
    fast.chat_template = CHATML_TEMPLATE
    if len(fast) != vocab_size:
        raise RuntimeError(
            f"tokenizer came out with {len(fast)} tokens, wanted {vocab_size}: the local training corpus "
            f"({len(files)} files) is too small for this vocabulary"
        )
    for t in SPECIAL_TOKENS + THINK_TOKENS:
        ids = fast.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"{t!r} does not encode to a single id: {ids}")
    fast.save_pretrained(str(out))


def ensure_tokenizer(vocab_size: int = MODEL_VOCAB) -> str:
    """Directory of a byte-level BPE tokenizer with exactly ``vocab_size`` tokens (built once, cached)."""
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an int >= 300 (256 bytes + specials), got {vocab_size!r}")
    return _build_once(f"tokenizer-bpe{vocab_size}-r{RECIPE_VERSION}", lambda d: _build_tokenizer(d, vocab_size))


# ---------------------------------------------------------------------------------------------
# models

ARCHS = ("deepseek_v3", "qwen3", "llama")

_YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _config(arch: str, ids: dict):
    common = dict(
        vocab_size=MODEL_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **ids,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_key_value_heads=4, **common), {}
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(num_key_value_heads=2, head_dim=32, **common), {}
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(
            num_key_value_heads=4,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            rope_scaling=dict(_YARN),
            num_nextn_predict_layers=0,
            **common,
        )
        # SGLang 0.5.23's DeepseekV2/V3 reads these keys from config.json directly; transformers 5
        # writes yarn under ``rope_parameters`` only, so add the legacy spelling too.
        extra = {
            "rope_scaling": dict(_YARN),
            "moe_layer_freq": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        }
        return cfg, extra
    raise ValueError(f"unknown tiny model arch {arch!r}; expected one of {', '.join(ARCHS)}")


def _build_model(out: Path, arch: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = ensure_tokenizer(MODEL_VOCAB)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = dict(
        bos_token_id=tok.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tok.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
    )
    config, extra = _config(arch, ids)
    seed = 1234 + ARCHS.index(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data.update(extra)
    data["torch_dtype"] = "bfloat16"
    data.setdefault("dtype", "bfloat16")
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    gen = out / "generation_config.json"
    gen.write_text(json.dumps({**ids, "do_sample": False}, indent=2) + "\n")


def ensure_model(arch: str) -> str:
    """Directory of a tiny random-weight ``arch`` model (one of :data:`ARCHS`), built once, cached."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; expected one of {', '.join(ARCHS)}")
    return _build_once(f"tiny-{arch}-r{RECIPE_VERSION}", lambda d: _build_model(d, arch))


# ---------------------------------------------------------------------------------------------
# DSpark draft for the tiny Qwen3 target (stock ``sglang.srt.models.dspark.Qwen3DSparkModel``)

#: the draft's geometry; ``target_layer_ids`` must name target layers whose *output* the 2-layer
#: Qwen3 target can capture (it captures after layer id + 1, so only layer 0 here)
DSPARK_DRAFT = dict(layers=1, block_size=4, markov_rank=16, target_layer_ids=(0,), mask_token=PAD_TOKEN)


def _build_dspark_draft(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    target = Path(ensure_model("qwen3"))
    tc = json.loads((target / "config.json").read_text())
    H, V, inter = tc["hidden_size"], tc["vocab_size"], tc["intermediate_size"]
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    L, R = DSPARK_DRAFT["layers"], DSPARK_DRAFT["markov_rank"]
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(str(target)).convert_tokens_to_ids(DSPARK_DRAFT["mask_token"])
    cfg = dict(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        hidden_size=H,
        intermediate_size=inter,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        vocab_size=V,
        rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        rope_theta=tc.get("rope_theta", 1000000.0),
        max_position_embeddings=tc["max_position_embeddings"],
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        dtype="bfloat16",
        block_size=DSPARK_DRAFT["block_size"],
        num_target_layers=tc["num_hidden_layers"],
        markov_rank=R,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        dflash_config={"target_layer_ids": list(DSPARK_DRAFT["target_layer_ids"]), "mask_token_id": mask_id},
        bos_token_id=tc.get("bos_token_id"),
        eos_token_id=tc.get("eos_token_id"),
        pad_token_id=tc.get("pad_token_id"),
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    g = torch.Generator().manual_seed(4321)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    sd = {}
    for i in range(L):
        p = f"layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": rand(nh * hd, H),
                p + "self_attn.k_proj.weight": rand(nkv * hd, H),
                p + "self_attn.v_proj.weight": rand(nkv * hd, H),
                p + "self_attn.o_proj.weight": rand(H, nh * hd),
                p + "self_attn.q_norm.weight": ones(hd),
                p + "self_attn.k_norm.weight": ones(hd),
                p + "mlp.gate_proj.weight": rand(inter, H),
                p + "mlp.up_proj.weight": rand(inter, H),
                p + "mlp.down_proj.weight": rand(H, inter),
                p + "input_layernorm.weight": ones(H),
                p + "post_attention_layernorm.weight": ones(H),
            }
        )
    k = len(DSPARK_DRAFT["target_layer_ids"])
    sd.update(
        {
            "fc.weight": rand(H, k * H),
            "hidden_norm.weight": ones(H),
            "norm.weight": ones(H),
            "markov_head.markov_w1.weight": rand(V, R),
            "markov_head.markov_w2.weight": rand(V, R),
            "confidence_head.proj.weight": (torch.randn(1, H + R, generator=g) * 0.02).float(),
            "confidence_head.proj.bias": torch.zeros(1),
        }
    )
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)


DSPARK_DRAFT_NAME = f"tiny-dspark-draft-qwen3-r{RECIPE_VERSION}"


def ensure_dspark_draft() -> str:
    """Directory of a tiny random-weight DSpark draft (``Qwen3DSparkModel``) for ``ensure_model("qwen3")``
    (``--speculative-algorithm DSPARK --speculative-draft-model-path <dir>``), built once, cached."""
    return _build_once(DSPARK_DRAFT_NAME, _build_dspark_draft)


def dspark_draft_dir() -> str:
    """Where :func:`ensure_dspark_draft` builds the draft, without building it (for a server
    configuration declared at import; call ``ensure_dspark_draft()`` before starting the server)."""
    return str(cache_dir() / DSPARK_DRAFT_NAME)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_harden.devtools.tiny_models", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--all", action="store_true", help="build every model arch and the 2048 + 32000 tokenizers")
    ap.add_argument("--arch", action="append", choices=ARCHS, default=[], help="model arch to build (repeatable)")
    ap.add_argument("--vocab", action="append", type=int, default=[], help="tokenizer vocab size to build (repeatable)")
    args = ap.parse_args(argv)
    archs = list(ARCHS) if args.all else args.arch
    vocabs = sorted({MODEL_VOCAB, 32000} | set(args.vocab)) if args.all else args.vocab
    if not archs and not vocabs:
        archs = list(ARCHS)
    for v in vocabs:
        print(f"tokenizer {v}: {ensure_tokenizer(v)}", flush=True)
    for a in archs:
        print(f"model {a}: {ensure_model(a)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
