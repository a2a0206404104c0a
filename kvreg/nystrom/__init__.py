"""The O(1) Nyström far-field state of a sealed layer (one per KV group).

After ``o1_seal`` a layer keeps no per-position storage. Each KV group keeps:

* the **sinks**: the first ``sink`` rows, K and V exact;
* the **window**: the last ``w`` rows, K and V exact, as a ring;
* the **heavy rows**: ``heavy`` far rows of largest prompt attention mass,
  K and V exact (see "Heavy rows" below);
* the **far field**, every other row between them, summarized by ``m`` landmark
  keys (rectangle :attr:`O1Rect.Aggregate`: ``K̃ [m, hd]`` = means of the far
  keys over ``m`` contiguous segments of the far rows at the seal).

Estimator. For a decode query ``q`` the far field is ``F(q) = Σ_far
exp(s·q·k)·[v, 1]`` (``s`` the logit scale; numerator and denominator of the
far part of attention). It is estimated as ``F(q) ≈ φ(q)·W`` with features
``φ(q) = exp(s·q·K̃ᵀ) [m]`` and a map ``W [m, hd + 1]`` fit at the seal:

* prior ``W₀ = [Σ_seg v, n_seg]`` (the per-segment value sums and sizes):
  ``φ(q)·W₀`` is segment-mean pooling, and by Jensen (``exp`` is convex)
  ``n_j·exp(s·q·k̃_j) ≤ Σ_{i∈j} exp(s·q·k_i)``: its denominator is a lower
  bound on the true far denominator;
* probes ``Q_P [p, hd]`` per head, ``p = m``: ``⌈m/2⌉`` segment means of the
  head's far queries (the Nyström landmark queries: the whole prompt's query
  distribution) and the ``⌊m/2⌋`` most recent distinct prompt queries (where
  decode starts). The exact far sums ``F(Q_P)`` are kept, and scaled by each
  probe's attention denominator at the seal, ``D_s = e^{ν_s}``, so that each
  probe's error counts relative to its attention output;
* ``W = argmin_W ‖diag(1/D)·(Φ·W − F(Q_P))‖² + λ‖W − W₀‖²`` with ``Φ =
  φ(Q_P)``: ridge regression of the far sums on the features, shrunk toward
  pooling, ``λ = rcond·σ_max²`` of the row-scaled ``Φ``. In closed form ``W =
  W₀ + P·(F̂ − Φ·W₀)``, ``F̂ = diag(1/D)·F(Q_P)``, ``P = (ΦᵀΦ + λI)⁻¹Φᵀ``
  (``Φ`` row-scaled too): pooling, plus a correction fit to what pooling
  misses at the probes.

So a decode read is ``φ(q)·W₀ + φ(q)·P·E`` with the probes' residuals ``E =
F̂ − Φ·W₀``: O(m·(p + hd) + p·hd) per head. Both terms are sums over far rows,
so a row leaving the window is absorbed exactly in O(p·hd) per head: it joins
the last segment's sums (``n``, ``Σv``; the segment keeps its key ``k̃``), so
its pooled stand-in is ``exp(s·Q_P·k̃_last)·[v, 1]`` and ``E`` gains
``(exp(s·Q_P·k) − exp(s·Q_P·k̃_last))·[v, 1]`` (scaled by ``1/D``).

Checks. ``φ·P`` has entries of both signs, so the correction can cancel the
pooled part. Two facts of the exact far field bound the estimate: its
denominator is at least the pooled one (Jensen, above; so the correction's
denominator must be ≥ 0) and its average ``num/den`` is a convex combination of
the far values, so it lies in their per-channel box ``[vlo, vhi]`` (kept per
group, widened by every absorbed row). A read that fails either drops the
correction: the pooled estimate passes both. (The clamp of a negative
denominator at zero that they replace let nearly cancelled sums through: p99
output error 9.75 at 8k context, m 16; on the real attention data of
``o1_report --real`` the box check takes the p99 of the far-heavy reads at 2k
context, w 64, m 64 from 15.2 to 2.9.)

Why this estimator (measured with ``research/o1_report.py`` on realistic data,
seeds 0 and 1, and on its real attention data): plain Nyström (``p = m``
segment-mean probes interpolated with a truncated pseudo-inverse, no prior)
came within 0.93x of pooling at 32k context, m 16 (median output error 0.72
against 0.77) and its far denominator cancelled at 8k. With probes from the
recent queries the 32k, m 16 median is 0.45-0.49 (0.51-0.59x pooling; every
row of the report is within 0.6x); the segment-mean probes keep the error
where plain Nyström's is when decode runs 1024 steps past the seal (recent
probes alone drift above it); shrinking toward pooling rather than toward
zero makes the estimate exact when every segment is one row; and ``rcond``
anywhere in 1e-4..1e-2 keeps every row within 0.63x of pooling (1e-6 does
is worse in every row: the fit starts to interpolate noise).

Stored per head (float64): ``probes [p, hd]``, ``m_hat = P [m, p]``, ``r = ν
[p]`` (log ``D_s``), the residual sums with an online-softmax stabilizer ``c
[p]`` (``z``, ``theta``: ``E = e^{c − ν}·[theta, z]``) and ``last_logit [p] =
s·Q_P·k̃_last``; per group ``k_tilde``, ``count``, ``vsum`` (``W₀``), ``vlo`` and
``vhi``. A decode step puts the exact part (sinks + heavy rows + window) and the far part
under ONE shared max ``μ`` (every exponent ≤ 0) and returns ``(num_exact +
num_far) / (den_exact + den_far)``.

Precision: the exact rows are stored float32 (they are the cache's rows); the
landmark state is float64 and the step computes in float64: ``φ·P`` has
entries of both signs, so the correction cancels in part. The landmark state
is O(m·(m + hd)) per head, so the doubled width costs nothing that grows with
context.

Heavy rows. Mean-based summaries cannot represent needle-like far
attention (a few far rows of very high logit: on the real data of
``o1_report --real`` the far estimate recovered ~0.01-0.05 of an exact far
mass of ~0.3). So the seal keeps ``heavy`` far rows (default ``m``: the
memory of ``m`` more exact rows) EXACT, with the sinks and the window: the
far rows of largest attention mass under a sample of the prompt's queries
(:func:`heavy_select`: the ``HEAVY_QUERIES // hpk`` most recent distinct
positions, every head of the group, each query causal and normalized, float32
logits). They leave the far field (segments, pooling prior, value box and
the probes' far sums; the probes' ``ν`` still spans the whole prompt) and
join the exact rows the step takes (``sinks | heavy | window ring``), so the
step kernels are unchanged and a step costs O((sink + heavy + w)·hd +
m·(m + hd)) per head. At least one far row stays (``min(heavy, far − 1)``
are kept). Measured on that real data (2048 rows, decode right after the
seal): the recent queries pick better rows than evenly spaced ones or every
prompt query (``HEAVY_EVEN`` mixes evenly spaced ones in), and 64 query
vectors as well as 256.

Degenerate case: a prompt of ``t <= sink + w`` rows has no far field; the
state is then exact-only. Decode rows keep filling the window; once a row must
leave a full window of an exact-only state it is dropped (the StreamingLLM
fallback: there are no landmarks to fold it into). ``dropped`` counts them.
``o1_seal`` never builds such a state: it waits for ``o1_deferred_boundary``.

Kernels for backends: :func:`nystrom_prefill` (far sums of the probes over the
prompt's far rows), :func:`nystrom_absorb` (one row into the far sums) and
:func:`nystrom_step` (one decode read of every head of a group). Each takes and
returns plain arrays; :class:`NystromState` calls them through its
``kernels`` object (this module by default), so a backend passes its own
namespace with the same three names and inherits nothing else. The seal-time
fit (:func:`far_fit`) is shared: it is small (O(p·m²) per head).
"""

from __future__ import annotations

from .estimator import *  # noqa: F403  (the estimator's public names)
from .estimator import __all__ as _estimator_names
from .state import NystromState, seal_groups

__all__ = [*_estimator_names, "NystromState", "seal_groups"]
