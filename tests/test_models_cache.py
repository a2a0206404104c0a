"""The converted-model cache of kvreg.models: a folder per key, published
whole, never rewritten under a process that maps its weights."""

import os

import pytest

torch = pytest.importorskip("torch")

from kvreg import models  # noqa: E402


class _Saves:
    def save_pretrained(self, path):
        (path / f"{type(self).__name__}.json").write_text("{}")


class _Model:
    def __init__(self, value):
        self.config = _Saves()
        self.value = value

    def state_dict(self):
        return {"w": torch.full((4,), float(self.value))}


def test_a_second_publish_of_the_same_key_leaves_the_first_folder_untouched(tmp_path):
    conv = tmp_path / "converted" / "m-0123"
    models._publish(conv, _Model(1), _Saves())
    weights = conv / "weights.pt"
    inode, mapped = weights.stat().st_ino, torch.load(weights, mmap=True)
    models._publish(conv, _Model(2), _Saves())   # a process that converted the same model at the same time
    assert weights.stat().st_ino == inode
    assert torch.equal(mapped["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in conv.parent.iterdir()) == ["m-0123"], "no temporary folder is left behind"


def test_the_cache_folder_is_named_for_what_it_holds(tmp_path, monkeypatch):
    # Installs whose GGUF files differ (another mtime) get folders of their own.
    monkeypatch.setenv("KVREG_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(models, "_publish", lambda conv, model, tok: seen.append(conv.name))
    monkeypatch.setattr(models, "gguf_path", lambda name: src)
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _LoadedModel())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x")
    models.load("smollm2-135m")
    os.utime(src, (1, 1))
    models.load("smollm2-135m")
    assert len(seen) == 2 and seen[0] != seen[1] and all(n.startswith("smollm2-135m-") for n in seen)


class _LoadedModel:
    def eval(self):
        return self
