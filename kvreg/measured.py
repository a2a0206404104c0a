"""Measured accuracy of each KV storage mode on real models: the one place
these figures live (``kvreg info`` prints them; docs/formats.md and the README quote them).

These are measurements of ``kvreg eval`` on CPython's ``textwrap.py``
(1024 tokens, prefix 256): the mean KL divergence of the next-token
distribution, KL(reference || mode) in nats, from the reference run (kvreg
``f32``, which equals ``DynamicCache``) over the 768 scored positions, and
the top-1 agreement with it, per mode and model. ``None`` is a figure not measured.

To regenerate, run :data:`COMMAND` (once per model, one model per process,
single-threaded) with the modes to measure in ``--configs``, and copy each mode's ``kl`` and ``top1`` from the JSON into
:data:`KL`; update :data:`DATE`.
"""

from __future__ import annotations

#: The measuring command, run once per model, each in its own process, with
#: ``OMP_NUM_THREADS=1 KVREG_THREADS=1 OPENBLAS_NUM_THREADS=1``. ``<stdlib>``
#: is ``sysconfig.get_paths()["stdlib"]`` (textwrap.py is ``default_texts()[0]``).
COMMAND = ("kvreg eval --model smollm2-135m --text <stdlib>/textwrap.py --tokens 1024 --prefix 256 "
           "--configs f16,bf16,q8,q8v,q4 --json ev.json; the same with --model gemma3-270m")

#: When the newest figures here were measured.
DATE = "2026-12-01"

MODELS = ("smollm2-135m", "gemma3-270m")

#: ``{mode value: {model: (mean KL, top-1 agreement as a fraction or None)}}``.
KL: dict[str, dict[str, tuple[float, float | None]]] = {
    "f16": {"smollm2-135m": (6.65e-7, 1.0), "gemma3-270m": (8.65e-7, 0.9974)},
    "bf16": {"smollm2-135m": (4.49e-5, 0.9987), "gemma3-270m": (3.37e-5, 0.9922)},
    # q8 and q8v as of 2026-12-01 (rows rotated, 8 newest rows float16); the
    # field-free q8 before the window measured 4.35e-4 (98.8%) / 9.19e-4 (98.2%).
    "q8": {"smollm2-135m": (7.69e-5, 0.9896), "gemma3-270m": (2.28e-4, 0.9844)},
    "q8v": {"smollm2-135m": (5.80e-6, 0.9987), "gemma3-270m": (8.05e-6, 0.9961)},
    "q4": {"smollm2-135m": (4.40e-3, 0.9648), "gemma3-270m": (2.58e-2, 0.9023)},
    "q8_2f": {"smollm2-135m": (1.25e-3, None), "gemma3-270m": (2.43e-2, None)},
}
