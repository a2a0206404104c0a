"""One KV group's sealed Nyström state (:class:`NystromState`), and the
seal of a layer's groups (:func:`seal_groups`)."""

from __future__ import annotations

import os
from typing import cast

import numpy as np

from kvreg.errors import ConfigError, ShapeError, StateError

from . import estimator
from .estimator import (
    FarField,
    O1Rect,
    far_fit,
    heavy_select,
    probe_log_den,
    recent_queries,
    segment_bounds,
    segment_means,
)

__all__ = ["NystromState", "seal_groups"]


def _check_finite(name: str, a: np.ndarray) -> None:
    if not np.all(np.isfinite(a)):
        raise ShapeError(f"{name}: expected finite values, found NaN or inf")


class NystromState:
    """One KV group's sealed O(1) attention state; see the module docstring.

    Build with :meth:`new_group`, fill once with :meth:`prefill_group`, then
    :meth:`step_group` per decode token. Memory (``memory_bytes``) is fixed
    at prefill: ``(sink + heavy + w)`` exact rows plus the O(hpk·m·(m + hd))
    landmark state, whatever the context length. ``rcond`` is the fit's ridge
    ``λ`` relative to ``σ_max²`` (:func:`far_fit`). ``heavy``: the far rows
    kept exact (module doc, "Heavy rows"); ``None`` = ``m`` (the memory of
    ``m`` more exact rows), ``0`` = none.
    """

    def __init__(self, m: int, w: int, sink: int, hpk: int, *, scale: float,
                 rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3, kernels=None,
                 heavy: int | None = None):
        if heavy is None:
            heavy = m
        for name, val, lo in (("m", m, 1), ("w", w, 1), ("sink", sink, 0), ("hpk", hpk, 1),
                              ("heavy", heavy, 0)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"NystromState: {name} must be an int >= {lo}, got {val!r}")
        if not (isinstance(scale, (int, float, np.floating)) and np.isfinite(scale) and scale > 0):
            raise ConfigError(f"NystromState: scale must be a finite float > 0, got {scale!r}")
        if not isinstance(rect, O1Rect):
            raise ConfigError(f"NystromState: rect must be an O1Rect, got {rect!r}")
        if not (0 < rcond < 1):
            raise ConfigError(f"NystromState: rcond must be in (0, 1), got {rcond!r}")
        self.m, self.w, self.sink, self.hpk = int(m), int(w), int(sink), int(hpk)
        self.heavy = int(heavy)
        self.scale = float(scale)
        self.rect = rect
        self.rcond = float(rcond)
        self.kernels = kernels if kernels is not None else estimator
        self.head_dim: int | None = None
        self.exact_k: np.ndarray | None = None  # [sink + n_heavy + w, hd]: sinks, heavy, ring
        self.exact_v: np.ndarray | None = None
        self.n_sink = 0  # sink rows held (< sink only for a prompt shorter than sink)
        self.n_heavy = 0  # heavy rows held (min(heavy, far rows - 1); 0 without far rows)
        self.heavy_pos = np.zeros(0, dtype=np.int64)  # their prompt positions (diagnostic)
        self._ring = self.sink  # slot of the ring's first row: sink + n_heavy
        self.win_head = 0  # ring slot of the oldest window row
        self.win_len = 0
        self.far: FarField | None = None
        self.seen = 0  # rows ever inserted (prompt + decode): the context depth
        self.dropped = 0  # rows lost by an exact-only state (see the module doc)

    @classmethod
    def new_group(cls, m: int, w: int, sink: int, hpk: int, *, scale: float,
                  rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3,
                  kernels=None, heavy: int | None = None) -> NystromState:
        """The seed's constructor name; same arguments as ``__init__``."""
        return cls(m, w, sink, hpk, scale=scale, rect=rect, rcond=rcond, kernels=kernels,
                   heavy=heavy)

    # -- properties

    @property
    def prefilled(self) -> bool:
        return self.exact_k is not None

    @property
    def exact_only(self) -> bool:
        """True when the prompt had no far rows (no landmarks)."""
        return self.prefilled and self.far is None

    @property
    def m_eff(self) -> int:
        """Landmarks actually built: ``min(m, far rows at the seal)``."""
        return 0 if self.far is None else self.far.k_tilde.shape[0]

    def _exact(self) -> tuple[np.ndarray, np.ndarray]:
        """``exact_k``, ``exact_v`` of a prefilled state (callers check
        :attr:`prefilled`, or run after the seal only)."""
        return cast(np.ndarray, self.exact_k), cast(np.ndarray, self.exact_v)

    def memory_bytes(self) -> int:
        if not self.prefilled:
            return 0
        far = self.far.nbytes() if self.far is not None else 0
        ek, ev = self._exact()
        return ek.nbytes + ev.nbytes + far

    # -- prefill

    def prefill_group(self, qs, k: np.ndarray, v: np.ndarray) -> None:
        """Seal the prompt: ``qs`` = ``hpk`` query traces ``[t, hd]`` (a list or
        a ``[hpk, t, hd]`` array, rotated queries of this group's heads), ``k``,
        ``v [t, hd]`` the group's rows. Refused (nothing changes) on a second
        call, a shape mismatch, ``t == 0`` or non-finite input."""
        if self.prefilled:
            raise StateError("NystromState.prefill_group: already prefilled (one seal per state)")
        k = np.asarray(k)
        v = np.asarray(v)
        if k.ndim != 2 or k.shape[0] < 1 or v.shape != k.shape:
            raise ShapeError(f"prefill_group: expected k, v [t >= 1, hd] of one shape, "
                             f"got k {k.shape}, v {v.shape}")
        t, hd = k.shape
        q: np.ndarray | None
        if isinstance(qs, np.ndarray):
            q = qs
        else:
            qs = list(qs)
            if len(qs) != self.hpk:
                raise ShapeError(f"prefill_group: expected {self.hpk} query traces, got {len(qs)}")
            q = np.stack([np.asarray(x) for x in qs]) if all(
                np.shape(x) == (t, hd) for x in qs) else None
        if q is None or q.shape != (self.hpk, t, hd):
            got = q.shape if q is not None else [np.shape(x) for x in qs]
            raise ShapeError(f"prefill_group: expected queries [{self.hpk}, {t}, {hd}], got {got}")
        for name, a in (("prefill_group q", q), ("prefill_group k", k), ("prefill_group v", v)):
            _check_finite(name, a)

        # everything validated: build the state
        n_sink = min(self.sink, t)
        n_win = min(self.w, t - n_sink)
        n_far = t - n_sink - n_win
        far = None
        heavy = np.zeros(0, dtype=np.int64)
        if n_far > 0:
            # at least one row stays far: the landmarks absorb later rows
            heavy = heavy_select(q, k, n_sink, t - n_win, min(self.heavy, n_far - 1), self.scale)
            far = self._far_field(q, k, v, n_sink, t - n_win, heavy)
        n_heavy = heavy.size
        ring = self.sink + n_heavy
        ek = np.zeros((ring + self.w, hd), dtype=np.float32)
        ev = np.zeros_like(ek)
        ek[:n_sink], ev[:n_sink] = k[:n_sink], v[:n_sink]
        ek[self.sink:ring], ev[self.sink:ring] = k[heavy], v[heavy]
        ek[ring:ring + n_win] = k[t - n_win:]
        ev[ring:ring + n_win] = v[t - n_win:]
        self.head_dim = hd
        self.exact_k, self.exact_v = ek, ev
        self.n_sink, self.win_head, self.win_len = n_sink, 0, n_win
        self.n_heavy, self.heavy_pos, self._ring = n_heavy, heavy, ring
        self.far = far
        self.seen = t

    def _far_field(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int,
                   hi: int, heavy: np.ndarray) -> FarField:
        """The landmark state of the far rows ``[lo, hi)`` of a prompt but
        the ``heavy`` ones (module doc): ``m_eff = min(m, far rows)`` segments
        of the remaining rows (in order), ``⌈m_eff/2⌉`` segment-mean probes
        (of the queries at every position of ``[lo, hi)``) and up to
        ``⌊m_eff/2⌋`` recent ones per head, the fit, the pooling prior and
        the probes' residuals."""
        if heavy.size:
            keep = np.ones(hi - lo, dtype=bool)
            keep[heavy - lo] = False
            kf, vf = k[lo:hi][keep], v[lo:hi][keep]
            k_exact = np.concatenate([k[:lo], k[heavy], k[hi:]])
        else:
            kf, vf = k[lo:hi], v[lo:hi]
            k_exact = np.concatenate([k[:lo], k[hi:]])
        n_far = kf.shape[0]
        m_eff = min(self.m, n_far)
        n_seg = (m_eff + 1) // 2
        k_tilde = segment_means(kf, m_eff)
        probes = segment_means(q[:, lo:hi], n_seg)
        if m_eff > n_seg:
            probes = np.concatenate([probes, recent_queries(q, m_eff - n_seg)], axis=1)
        c, z, theta = self.kernels.nystrom_prefill(probes, kf, vf, scale=self.scale)
        nu = probe_log_den(probes, k_exact, c, z, self.scale)
        m_hat = far_fit(probes, k_tilde, nu, self.scale, self.rcond)
        # the pooling prior W₀, and the probes' residuals E = F̂ − Φ·W₀ (in
        # units of e^{c − ν}: Φ·W₀·e^{ν − c} = exp(s·probes·K̃ᵀ − c)·W₀)
        b = segment_bounds(n_far, m_eff)
        count = np.diff(b).astype(np.float64)
        vsum = np.stack([vf[b[j]:b[j + 1]].sum(axis=0, dtype=np.float64)
                         for j in range(m_eff)])
        pl = self.scale * np.einsum("hjd,id->hji", probes, k_tilde)  # [hpk, p, m]
        stand_in = np.exp(pl - c[:, :, None])
        z = z - stand_in @ count
        theta = theta - stand_in @ vsum
        vlo = vf.min(axis=0).astype(np.float64)
        vhi = vf.max(axis=0).astype(np.float64)
        return FarField(k_tilde, probes, m_hat, nu, c, z, theta, n_far, count, vsum, vlo, vhi,
                        np.ascontiguousarray(pl[:, :, -1]))

    # -- decode

    def _check_step(self, q_group, k_new=None, v_new=None):
        if not self.prefilled:
            raise StateError("NystromState: step before prefill_group")
        hd = self.head_dim
        q = np.asarray(q_group)
        if q.shape != (self.hpk, hd):
            raise ShapeError(f"step_group: expected q_group [{self.hpk}, {hd}], got {q.shape}")
        _check_finite("step_group q_group", q)
        out = [q]
        for name, a in (("k_new", k_new), ("v_new", v_new)):
            if a is None:
                continue
            a = np.asarray(a)
            if a.shape != (hd,):
                raise ShapeError(f"step_group: expected {name} [{hd}], got {a.shape}")
            _check_finite(f"step_group {name}", a)
            out.append(a)
        return out

    def exact_rows(self):
        """Sinks, heavy and window rows ``(k, v)`` as contiguous views (no
        copy): the window occupies ring slots in some rotation, which attention
        does not see."""
        ek, ev = self._exact()
        n = self._ring + self.win_len if self.n_sink == self.sink else None
        if n is not None:
            return ek[:n], ev[:n]
        # a prompt shorter than `sink`: the window is empty until sinks fill
        return ek[:self.n_sink], ev[:self.n_sink]

    def _insert(self, k_row: np.ndarray, v_row: np.ndarray) -> None:
        ek, ev = self._exact()
        if self.n_sink < self.sink:
            ek[self.n_sink], ev[self.n_sink] = k_row, v_row
            self.n_sink += 1
        elif self.win_len < self.w:
            slot = self._ring + (self.win_head + self.win_len) % self.w
            ek[slot], ev[slot] = k_row, v_row
            self.win_len += 1
        else:
            slot = self._ring + self.win_head
            if self.far is not None:
                self.far = self.kernels.nystrom_absorb(self.far, ek[slot], ev[slot], scale=self.scale)
            else:
                self.dropped += 1
            ek[slot], ev[slot] = k_row, v_row
            self.win_head = (self.win_head + 1) % self.w
        self.seen += 1

    def attend_group(self, q_group: np.ndarray) -> np.ndarray:
        """Read the state for ``q_group [hpk, hd]`` without inserting a row:
        ``out [hpk, hd]`` float32."""
        (q,) = self._check_step(q_group)
        ke, ve = self.exact_rows()
        return self.kernels.nystrom_step(q, ke, ve, self.far, scale=self.scale)

    def step_group(self, q_group: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> np.ndarray:
        """One decode token: insert ``(k_new, v_new) [hd]`` into the window
        (the row leaving it moves into the far sums), then attend every head:
        ``q_group [hpk, hd]`` -> ``out [hpk, hd]`` float32. Refused before any
        change on a bad shape or a non-finite value."""
        q, k_row, v_row = self._check_step(q_group, k_new, v_new)
        self._insert(k_row, v_row)
        ke, ve = self.exact_rows()
        return self.kernels.nystrom_step(q, ke, ve, self.far, scale=self.scale)

    def window_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's rows, oldest first (copies): ``(k, v) [win_len, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.window_rows: not prefilled")
        idx = self._ring + (self.win_head + np.arange(self.win_len)) % self.w
        ek, ev = self._exact()
        return ek[idx].copy(), ev[idx].copy()

    def sink_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The sink rows (copies): ``(k, v) [n_sink, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.sink_rows: not prefilled")
        ek, ev = self._exact()
        return ek[:self.n_sink].copy(), ev[:self.n_sink].copy()

    def heavy_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The heavy rows (copies), in prompt order (positions
        ``heavy_pos``): ``(k, v) [n_heavy, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.heavy_rows: not prefilled")
        sl = slice(self.sink, self._ring)
        ek, ev = self._exact()
        return ek[sl].copy(), ev[sl].copy()


def seal_groups(trace: np.ndarray, keys: np.ndarray, values: np.ndarray, *, m: int, w: int, sink: int,
                rect: O1Rect, heavy: int | None, stride: int, scale: float, kernels) -> list[NystromState]:
    """Every KV group's sealed state of a layer (``far="nystrom"``): from the
    query ``trace [rows, num_heads, hd]`` (row ``p // stride`` is position
    ``p``'s) and the rows ``keys``/``values [nkv, t, hd]`` as attention reads
    them, each group's state prefilled on ``kernels`` (a backend). Raises
    :class:`~kvreg.errors.SealError` when a fit is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from kvreg.errors import SealError

    nkv, t = keys.shape[0], keys.shape[1]
    hpk = trace.shape[1] // nkv
    pick = None if stride == 1 else np.arange(t) // stride

    def seal_group(g: int) -> NystromState:
        state = NystromState.new_group(m, w, sink, hpk, scale=scale, rect=rect, kernels=kernels, heavy=heavy)
        # This group's heads, each head's queries contiguous: [hpk, t, hd].
        qg = trace[:, g * hpk:(g + 1) * hpk]
        qs = np.ascontiguousarray((qg if pick is None else qg[pick]).transpose(1, 0, 2))
        state.prefill_group(qs, keys[g], values[g])
        return state

    # One group's state depends on its rows alone, so groups can seal on
    # threads -- where the backend's kernels release the GIL without
    # threading themselves. The reference's GEMMs are already threaded by
    # BLAS: threads on top oversubscribe the cores (9x slower measured).
    try:
        if nkv > 1 and getattr(kernels, "parallel_seal", False):
            with ThreadPoolExecutor(max_workers=min(nkv, os.cpu_count() or 1)) as pool:
                return list(pool.map(seal_group, range(nkv)))
        return [seal_group(g) for g in range(nkv)]
    except (ShapeError, np.linalg.LinAlgError, FloatingPointError) as exc:
        # Nothing changed yet: a fit the states refuse is a failed seal.
        raise SealError(f"o1 seal: the far-field fit failed: {exc}") from exc
