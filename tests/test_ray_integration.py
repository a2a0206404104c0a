"""Prefill/decode disaggregation on Ray (kvreg.integrations.ray) with SmolLM2-135M.

A local Ray instance (2 CPUs) runs one prefill worker and three decode
workers, each an actor holding the model; the reference is one process
running ``model.generate`` with a ``KvregCache``. Hand-offs must give the
same greedy tokens, in F32 and q8, and a decode worker that dies mid-sequence
(``os._exit`` mid-chunk, ``ray.kill`` between chunks) must be replaced from
the last shipped state with no token lost or repeated.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import ray  # noqa: E402  (CI installs kvreg[ray]: a missing ray is a failure, not a skip)

from kvreg.errors import ConfigError, StateError, WireError  # noqa: E402
from kvreg.integrations.ray import DecodeWorker, PrefillWorker, SequenceMeta, generate  # noqa: E402
from kvreg.integrations.transformers import KvregCache  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
NEW = 20
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="kvreg-ray-")   # short: Ray's socket paths must fit 107 bytes
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp,
             object_store_memory=256 * 2**20, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def lm(pretrained):
    return pretrained(MODEL)


@pytest.fixture(scope="module")
def workers(cluster, request):
    """Started together (each loads the model) while the driver loads its own
    and runs the reference."""
    ws = {"prefill": PrefillWorker.remote(MODEL), "decode": DecodeWorker.remote(MODEL),
          "exits": DecodeWorker.remote(MODEL, exit_after=6), "killed": DecodeWorker.remote(MODEL)}
    request.getfixturevalue("reference")
    ray.get([w.ready.remote() for w in ws.values()])
    return ws


def _reference(lm, mode, n=NEW):
    model, tok = lm
    inputs = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, cache=KvregCache(model, mode=mode), max_new_tokens=n, do_sample=False)
    return out[0, inputs.input_ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference(lm):
    return {mode: _reference(lm, mode) for mode in ("f32", "q8")}


def _eos(lm):
    return lm[0].generation_config.eos_token_id


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_handoff_continues_as_one_process(workers, reference, lm, mode):
    res = generate(workers["prefill"], [workers["decode"]], PROMPT, max_new_tokens=NEW, every=8,
                   eos_token_id=_eos(lm), mode=mode)
    assert res.tokens == reference[mode], (mode, lm[1].decode(res.tokens), lm[1].decode(reference[mode]))
    assert res.resumes == 0 and not res.failures
    assert res.checkpoints == 3                         # 19 decoded tokens, 8 per checkpoint
    n_in = len(lm[1](PROMPT)["input_ids"])
    assert res.meta.seen == n_in + NEW - 1 and res.meta.cache_options["mode"] == mode


def test_prefill_ships_the_exact_cache_bytes_in_q8(workers, lm):
    """The blob the prefill worker ships is the driver's own export of the
    same prefill, byte for byte (q8's v3 records: int8 blocks, scales, the
    f16 window), and a cache of the other mode refuses it."""
    model, tok = lm
    meta_ref, wire_ref = workers["prefill"].prefill.remote(PROMPT, max_new_tokens=4, mode="q8")
    meta, wire = ray.get([meta_ref, wire_ref])
    ids = tok(PROMPT, return_tensors="pt").input_ids
    mine = KvregCache(model, mode="q8")
    with torch.no_grad():
        logits = model(input_ids=ids, cache=mine, use_cache=True).logits
    assert bytes(wire) == mine.export_wire() and meta.wire_bytes == len(wire)
    assert meta.tokens == (int(logits[0, -1].argmax()),) and meta.seen == ids.shape[1]
    other = KvregCache(model, mode="f32")
    with pytest.raises(WireError, match="mode='q8'"):
        other.import_wire(wire)
    assert other.get_seq_length() == 0


def test_dead_decode_workers_are_replaced_from_the_last_checkpoint(workers, reference, lm):
    """Decode worker 0 exits (os._exit) mid-chunk after 6 tokens, worker 1 is
    ray.kill-ed right after its first checkpoint; worker 2 finishes. Every
    shipped state is a prefix of the single-process tokens, and the result
    is that run, token for token."""
    decoders = [workers["exits"], workers["killed"], workers["decode"]]
    shipped = []

    def on_checkpoint(meta, index):
        shipped.append((index, meta.tokens))
        if index == 1:
            ray.kill(decoders[1])

    res = generate(workers["prefill"], decoders, PROMPT, max_new_tokens=NEW, every=4, eos_token_id=_eos(lm),
                   on_checkpoint=on_checkpoint, mode="f32")
    assert res.tokens == reference["f32"]
    assert [i for i, _ in res.failures] == [0, 1] and res.resumes == 2
    ref = tuple(reference["f32"])
    assert all(toks == ref[:len(toks)] for _, toks in shipped)
    # Worker 0 shipped one checkpoint (5 tokens) and died in its second chunk;
    # worker 1 resumed from those 5, shipped 9 and was killed.
    assert [(i, len(t)) for i, t in shipped][:2] == [(0, 5), (1, 9)]
    assert all(i == 2 for i, _ in shipped[2:]) and len(shipped[-1][1]) == NEW


def test_a_padded_batch_travels_whole(lm):
    """KvregCache.export_wire carries every sequence (of different lengths:
    pads are not stored) and the seen counts: the importer's next step is
    the exporter's, bit for bit."""
    model, tok = lm
    side, tok.padding_side = tok.padding_side, "left"
    try:
        batch = tok([PROMPT, "The capital of France is"], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    assert not bool(batch.attention_mask.all())
    cache = KvregCache(model, mode="q8")
    with torch.no_grad():
        nxt = model(**batch, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    twin = KvregCache(model, mode="q8")
    twin.import_wire(cache.export_wire())
    assert [s.layers[0].seq_len for s in twin.sequences] == [s.layers[0].seq_len for s in cache.sequences]
    assert twin.get_seq_length() == cache.get_seq_length() == batch.input_ids.shape[1]
    mask = torch.cat([batch.attention_mask, torch.ones_like(nxt)], dim=1)
    with torch.no_grad():
        a, b = (model(input_ids=nxt, attention_mask=mask, cache=c, use_cache=True).logits for c in (cache, twin))
    assert torch.equal(a, b) and twin.export_wire() == cache.export_wire()


def test_refusals_change_nothing(workers, lm):
    model, tok = lm
    ids = tok(PROMPT, return_tensors="pt").input_ids
    cache = KvregCache(model, mode="f32")
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    good = cache.export_wire()
    target = KvregCache(model, mode="f32")
    with torch.no_grad():
        model(input_ids=ids[:, :5], cache=target, use_cache=True)
    before = target.export_wire()
    seq_blob = cache.sequences[0].export_wire()
    bad = [
        (b"nope" + good[4:], "expected magic"),
        (seq_blob, "KvCache.import_wire"),
        (good[:-3], "truncated"),
        (good + b"\0", "trailing"),
        (good[:4] + b"\x07" + good[5:], "expected version 1"),
        (12, "bytes-like"),
    ]
    # Layer 0's record claims another layer: changed in transit, its
    # container's CRC-32 refuses it; sent so (its CRC matching), the
    # KvCache's own refusal, named.
    rec = good.find(b"KVRC") + 20                  # KVRC, version, count, u64 length, then CMFS
    assert good[rec:rec + 4] == b"CMFS"
    changed = bytearray(good)
    changed[rec + 16] = 7
    bad.append((bytes(changed), "sequence 0 .*layer 0's blob .*fails its CRC-32"))
    n = struct.unpack_from("<Q", good, rec - 8)[0]
    struct.pack_into("<I", changed, rec + n, zlib.crc32(changed[rec:rec + n]))
    bad.append((bytes(changed), "sequence 0 .*layer 7"))
    for blob, match in bad:
        with pytest.raises(WireError, match=match):
            target.import_wire(blob)
        assert target.export_wire() == before and target.get_seq_length() == 5
    with pytest.raises(WireError, match="mode='f32'"):
        KvregCache(model, mode="q8").import_wire(good)
    with pytest.raises(WireError, match="q8_exact_rows=8"):
        KvregCache(model, mode="q8", q8_exact_rows=4).import_wire(KvregCache(model, mode="q8",
                                                                          q8_exact_rows=8).export_wire())
    with pytest.raises(ConfigError, match="O\\(1\\) seal"):
        KvregCache(model, o1=(8, 16, 4)).export_wire()

    # Through the workers: the error class survives Ray; the worker stays usable.
    dec, pre = workers["decode"], workers["prefill"]
    meta_ref, wire_ref = pre.prefill.remote(PROMPT, max_new_tokens=8, mode="f32")
    meta = ray.get(meta_ref)
    with pytest.raises(WireError, match=f"expected {meta.seen + 1}"):
        ray.get(dec.load.remote(SequenceMeta(**{**meta.__dict__, "tokens": meta.tokens + (5,)}), wire_ref))
    with pytest.raises(ConfigError, match="expected a SequenceMeta"):
        ray.get(dec.load.remote({"tokens": [1]}, wire_ref))
    with pytest.raises(WireError, match="not the one its meta describes"):
        ray.get(dec.load.remote(meta, b"KVRX" + bytes(40)))
    with pytest.raises(WireError, match="expected magic"):   # a meta without a checksum: the blob's own checks
        ray.get(dec.load.remote(replace(meta, wire_crc32=None, wire_bytes=44), b"KVRX" + bytes(40)))
    with pytest.raises(StateError, match="not loaded here"):
        ray.get(dec.decode.remote("no-such-request", 4)[0])
    with pytest.raises(ConfigError, match="cache options"):
        ray.get(pre.prefill.remote(PROMPT, max_new_tokens=4, o1=(8, 16, 4))[0])
    with pytest.raises(ConfigError, match="token ids"):
        ray.get(pre.prefill.remote([], max_new_tokens=4)[0])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        ray.get(pre.prefill.remote(PROMPT, max_new_tokens=0)[0])
    with pytest.raises(ConfigError, match="every"):
        generate(pre, [dec], PROMPT, max_new_tokens=4, every=0)
    assert ray.get(dec.load.remote(meta, wire_ref)) == meta.seen
    m2 = ray.get(dec.decode.remote(meta.request_id, 3)[0])
    assert len(m2.tokens) == 4 and m2.checkpoint == 1
    assert ray.get(dec.release.remote(meta.request_id))


def test_a_state_changed_in_transit_is_refused_by_the_worker_which_stays_usable(workers):
    """Bytes flipped in the shipped blob, mostly inside row payloads (where
    the blob's own structure cannot notice): the worker refuses every one
    by the meta's CRC-32, and without it by the containers' per-record
    CRC-32 and its own checks; the sound state then loads and decodes."""
    dec, pre = workers["decode"], workers["prefill"]
    meta_ref, wire_ref = pre.prefill.remote(PROMPT, max_new_tokens=4, mode="q8")
    meta, wire = ray.get([meta_ref, wire_ref])
    assert meta.wire_crc32 == zlib.crc32(wire) and meta.wire_bytes == wire.size
    rng = np.random.default_rng(8)
    bare = replace(meta, wire_crc32=None)
    for i in range(45):
        bad = np.array(wire)
        at = int(rng.integers(0, bad.size)) if i % 3 == 0 else int(rng.integers(bad.size // 8, bad.size))
        bad[at] ^= np.uint8(1 << int(rng.integers(0, 8)))
        for m in (meta, bare):
            with pytest.raises(WireError):
                ray.get(dec.load.remote(m, bad))
    assert ray.get(dec.load.remote(meta, wire_ref)) == meta.seen
    assert len(ray.get(dec.decode.remote(meta.request_id, 2)[0]).tokens) == 3
    assert ray.get(dec.release.remote(meta.request_id))


def test_the_module_needs_ray_and_says_how_to_get_it():
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    import kvreg.integrations.ray\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("ConfigError") and "pip install 'kvreg[ray]'" in out, out


@pytest.mark.real_models
@pytest.mark.parametrize("mode", ["f16", "q4"])
def test_long_handoff_with_a_born_budget(workers, lm, mode):
    """A 96-token run on a Born(4) budget of 32 rows per layer: the decode
    worker carries the evicted rows and their attention mass on, as one
    process does."""
    model, tok = lm
    inputs = tok(PROMPT * 2, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, cache=KvregCache(model, mode=mode, budget=32), max_new_tokens=96,
                             do_sample=False)
    ref = out[0, inputs.input_ids.shape[1]:].tolist()
    res = generate(workers["prefill"], [workers["decode"]], PROMPT * 2, max_new_tokens=96, every=16,
                   eos_token_id=_eos(lm), mode=mode, budget=32)
    assert res.tokens == ref
