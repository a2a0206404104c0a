"""Every tolerance of the conformance suite, declared once with its reason.

``TOLERANCES[kernel] = (rtol, atol, reason)``: a value passes when
``|got - expected| <= atol + rtol * |expected|`` elementwise (NaN only where
NaN is expected), or ``atol + rtol * max|expected|`` where the reason says
rtol is relative to the largest value (``check.close(..., relative_to_max=True)``).
Anything not in this table is compared bit for bit, and no case of the suite
writes a bound of its own.

The expected value is the float64 oracle (:mod:`kvreg_conformance.oracle`) unless
the kernel name says otherwise. The bounds are a few float32 roundings per
accumulated term above what a correct float32 kernel produces on the
suite's inputs (|q|, |k|, |v| <= ~4, hd <= 128, rows <= ~300); every bug the
suite is meant to catch (a row too many or too few, a dropped sink, unsummed
importance) moves a value by 1e-3 or more.
"""

from __future__ import annotations

TOLERANCES: dict[str, tuple[float, float, str]] = {
    "attend_group": (1e-4, 2e-5,
                     "float32 dot products over hd channels and a float32 softmax over <= ~300 rows; "
                     "summation order is the backend's (blocked, SIMD, tree) so only ~hd·eps per score holds"),
    "attend_probs": (1e-4, 1e-5,
                     "probabilities inherit the score error through exp: relative error ~ |score| · hd · eps"),
    "importance": (1e-4, 3e-5,
                   "Σ over the group's heads of probabilities: one more float32 sum over <= 8 heads"),
    "attend_layer": (1e-4, 2e-5, "same arithmetic as attend_group, every group in one call"),
    "attend_chunk": (1e-4, 3e-5,
                     "batched causal prefill: GEMM summation order differs from the per-row path"),
    "attend_chunk_importance": (1e-3, 1e-4,
                                "masked column sums of b·nh probabilities each carrying attend_chunk's error"),
    "freeze_rms": (1e-5, 1e-7,
                   "float32 sum of squares in row order over <= 64 rows, then sqrt: ~n·eps relative"),
    "bounded_attend": (1e-5, 1e-5,
                       "float32 RoPE (angles pos·theta^(-2i/d) rounded once) and a float32 softmax"),
    "nystrom_step": (1e-4, 1e-5,
                     "float64 landmark algebra but float32 exact rows and output; the oracle's ridge "
                     "fit (normal equations) and the kernel's (SVD) differ by rounding"),
    "nonfinite_vs_reference": (2e-3, 2e-4,
                               "finite entries of a case with NaN/inf inputs, against the reference (the "
                               "f64 oracle takes no NaN): each within the kernel's tolerance of the oracle "
                               "(attend_chunk_importance the loosest), so of each other within twice it"),
    "wire_cross_backend": (1e-4, 2e-5,
                           "state exported by one backend, imported by another: each answers within "
                           "attend_group's tolerance of the oracle, so of each other within twice it"),
    # Storage modes against each other on the same backend (not the oracle).
    "q8_vs_f32_output": (0.03, 1e-3,
                         "a q8 (2f) layer's attention output against an F32 layer holding the same rows; "
                         "rtol relative to the output's largest |value|: int8 rows at 127 steps per scale "
                         "group move each score and value by up to half a step (~0.4% of the group's max), "
                         "summed over the rows (the Rust engine's own q8 test bound)"),
    "q8_vs_f32_probs": (0.0, 0.02,
                        "the same layers' probabilities, absolute: the score error above, through exp"),
    # The backends' own unit tests: small inputs, so tighter than the suite's bounds.
    "decode_small": (1e-5, 2e-6,
                     "a decode kernel against the f64 oracle over <= 64 rows of |x| <= ~4: float32 "
                     "accumulation of that few terms stays within ~64 eps relative"),
    "decode_small_scaled": (2e-5, 2e-5,
                            "the same, as one bound relative to the largest |expected| (at least 1): "
                            "the OpenCL tests' check_close"),
    "bounded_large_logits": (1e-4, 1e-4,
                             "bounded_attend at scores of ~1e3: a float32 score carries ~6e-5 absolute "
                             "error into exp()"),
}


def tolerance(kernel: str) -> tuple[float, float, str]:
    """``(rtol, atol, reason)`` of ``kernel``; KeyError names the table."""
    try:
        return TOLERANCES[kernel]
    except KeyError:
        raise KeyError(f"no tolerance declared for {kernel!r} in kvreg_conformance/tolerances.py "
                       f"(exact comparisons use check.exact)") from None
