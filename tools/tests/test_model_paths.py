"""``kvreg generate`` / ``kvreg eval`` / ``kvreg.models.load`` on a model on
disk: a transformers checkpoint directory or a GGUF file, not only the
bundled names."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvreg.cli import main  # noqa: E402
from kvreg.errors import ConfigError  # noqa: E402
from kvreg.models import load  # noqa: E402

TEXT = ("The cache keeps the keys and values of every token the model has seen, so each new token "
        "attends to them without running the prompt again. ") * 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama and a word-level tokenizer, saved as a host would."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("ckpt")
    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, initializer_range=0.2,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert len(tok) <= config.vocab_size
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_load_reads_a_checkpoint_directory(checkpoint):
    model, tok = load(str(checkpoint))
    assert not model.training and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 2
    assert tok("the cache").input_ids


def test_load_refuses_a_folder_without_a_checkpoint_or_tokenizer(tmp_path, checkpoint):
    with pytest.raises(ConfigError, match="config.json"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ConfigError, match="tokenizer"):
        load(str(tmp_path))
    with pytest.raises(ConfigError, match="checkpoint directory"):
        load("no-such-model")


def test_generate_runs_a_checkpoint_directory_beside_dynamic_cache(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--tokens", "8", "--prompt", "the cache keeps"]) == 0
    out = capsys.readouterr().out
    assert f"model: {checkpoint}" in out
    assert "tokens identical to DynamicCache's: yes" in out


def test_eval_scores_a_checkpoint_directory(checkpoint, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(checkpoint), "--text", str(text), "--tokens", "64", "--prefix", "32",
                 "--configs", "dynamic,q8", "--json", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())           # one model and text: one record
    ref, (dyn, q8) = rep["reference"], rep["results"]
    assert rep["model"] == str(checkpoint) and rep["scored"] == 32
    assert dyn["kl_mean"] < 1e-6 and abs(dyn["ppl"] / ref["ppl"] - 1) < 1e-4
    assert q8["kv_bytes"] < 0.4 * ref["kv_bytes"]


@pytest.mark.real_models
def test_load_reads_a_gguf_file_as_its_bundled_name_does():
    from kvreg.models import gguf_path

    try:
        path = gguf_path("smollm2-135m")
    except ConfigError as exc:
        pytest.skip(str(exc))
    by_file, _ = load(str(path))
    by_name, _ = load("smollm2-135m")
    a, b = by_file.state_dict(), by_name.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
