"""Validation at the public edge: each helper returns the clean value or raises
a kvreg error that names what was expected. Kernels trust what passes here."""

from __future__ import annotations

import numbers
import operator

import numpy as np

from .errors import ShapeError

_F32 = np.dtype(np.float32)

__tracebackhide__ = True


def _from_torch(x):
    """A torch tensor as a numpy array sharing its memory where it can (a
    CPU tensor of a dtype numpy has; bfloat16 is widened, a device tensor
    copied to the host); anything else unchanged. torch is never imported."""
    if not type(x).__module__.startswith("torch") or not hasattr(x, "detach"):
        return x
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    return t.cpu().numpy()


def _as_f32(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = _from_torch(x)
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            if np.can_cast(x.dtype, np.float32, casting="safe"):
                return x.astype(np.float32)
            return _lossless(name, x, x.dtype)
        return x
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{name} must be an array of floats: {exc}") from None
    if arr.dtype.kind not in "biuf":
        raise ShapeError(f"{name} has dtype {arr.dtype}; expected float32 values")
    # Python numbers (decimal literals) are taken as float32 values: only a
    # numpy array's explicit dtype is held to a lossless cast.
    return arr.astype(np.float32)


def _lossless(name: str, x: np.ndarray, dtype) -> np.ndarray:
    """float64 (or int) values that float32 holds exactly are accepted."""
    if x.dtype.kind not in "biuf":
        raise ShapeError(f"{name} has dtype {dtype}; expected float32 values")
    y = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        same = (y == x) | (np.isnan(y) & np.isnan(x))
    if not same.all():
        raise ShapeError(f"{name} has dtype {dtype} with values float32 cannot hold exactly; "
                         f"expected float32 (cast it yourself if the rounding is intended)")
    return y


#: The largest integer argument: int64, what kernels and the wire's u64
#: fields index with. A Python int past it is refused, never wrapped.
MAX_INT = 2**63 - 1
#: The largest absolute position: float64 holds every integer up to 2**53
#: exactly, and RoPE angles are ``position * inv_freq`` in float64.
MAX_POSITION = 2**53


def integer(name: str, x, lo: int = 0, hi: int = MAX_INT, what: str | None = None) -> int:
    """``x`` as a Python int in ``[lo, hi]``: Python and numpy integers alike
    (a ``np.uint8`` must not wrap at 256 inside the layer), bools refused.
    Every integer argument goes through here, and methods compute with the
    returned int only."""
    if type(x) is int:       # the common case, before the ABC checks (bool is not int's type)
        v = x
    elif isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise ShapeError(f"{name} must be {what or f'an integer in [{lo}, {hi}]'}, got {x!r}")
    else:
        v = operator.index(x)
    if not lo <= v <= hi:
        bound = "2**53 (positions float64 resolves)" if hi == MAX_POSITION else (
            "2**63-1" if hi == MAX_INT else str(hi))
        raise ShapeError(f"{name} must be {what or f'an integer in [{lo}, {hi}]'} (at most {bound}), got {v}")
    return v


def positive_int(name: str, x, hi: int = MAX_INT) -> int:
    return integer(name, x, 1, hi, "a positive integer")


def nonneg_int(name: str, x, hi: int = MAX_INT) -> int:
    return integer(name, x, 0, hi, "a non-negative integer")


def position(name: str, x) -> int:
    """An absolute position or depth: a non-negative integer <= 2**53."""
    return integer(name, x, 0, MAX_POSITION, "a non-negative integer position")


def flag(name: str, x) -> bool:
    """A boolean option: ``bool``/``np.bool_``, or an integer 0 or 1."""
    if x is True or x is False:
        return x
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (numbers.Integral, np.integer)) and operator.index(x) in (0, 1):
        return bool(x)
    raise ShapeError(f"{name} must be True or False, got {x!r}")


def index(name: str, x, n: int) -> int:
    return integer(name, x, 0, n - 1, f"an integer in [0, {n})")


def rows(name: str, x, nkv: int, hd: int) -> np.ndarray:
    """``nkv*hd`` floats, flat or ``[nkv, hd]`` -> C-contiguous float32 ``[nkv, hd]``."""
    if type(x) is np.ndarray and x.dtype is _F32 and x.shape == (nkv, hd) and x.flags.c_contiguous:
        return x     # a decode step's row: no numpy call (each costs ~10 µs inside a model)
    a = _as_f32(name, x)
    if a.shape not in ((nkv * hd,), (nkv, hd)):
        raise ShapeError(f"{name} has shape {a.shape}; expected ({nkv * hd},) or ({nkv}, {hd})")
    return np.ascontiguousarray(a.reshape(nkv, hd))


def heads(name: str, x, hd: int) -> np.ndarray:
    """``[nheads, hd]`` or a flat multiple of ``hd`` -> float32 ``[nheads, hd]``."""
    if type(x) is np.ndarray and x.dtype is _F32 and x.ndim == 2 and x.shape[1] == hd and x.shape[0] \
            and x.flags.c_contiguous:
        return x     # a decode step's queries: no numpy call (each costs ~10 µs inside a model)
    a = _as_f32(name, x)
    if a.ndim == 1 and a.size % hd == 0 and a.size:
        a = a.reshape(-1, hd)
    if a.ndim != 2 or a.shape[1] != hd or a.shape[0] == 0:
        raise ShapeError(f"{name} has shape {a.shape}; expected [nheads, {hd}] or a flat multiple of {hd}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def out_block(name: str, x, shape: tuple[int, ...]) -> np.ndarray:
    """An output buffer: a writable C-contiguous float32 array of ``shape``."""
    if not (type(x) is np.ndarray and x.dtype is _F32 and x.shape == shape and x.flags.c_contiguous
            and x.flags.writeable):
        what = (f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}").strip()
        raise ShapeError(f"{name} must be a writable C-contiguous float32 array of shape {shape}, got {what}")
    return x


def batch_heads(name: str, x, batch: int, hd: int) -> np.ndarray:
    """``[batch, nheads, hd]`` -> float32 (the queries of a batched decode)."""
    a = _as_f32(name, x)
    if a.ndim != 3 or a.shape[0] != batch or a.shape[2] != hd or a.shape[1] == 0:
        raise ShapeError(f"{name} has shape {a.shape}; expected [{batch} sequences, nheads, {hd}]")
    return np.ascontiguousarray(a)


def array(name: str, x, shape: tuple[int, ...]) -> np.ndarray:
    a = _as_f32(name, x)
    size = int(np.prod(shape))
    if a.shape != shape and not (a.ndim == 1 and a.size == size):
        raise ShapeError(f"{name} has shape {a.shape}; expected {shape} or ({size},)")
    return np.ascontiguousarray(a.reshape(shape))


#: Row layouts ``extend`` takes: token-major, head-major, and transformers'
#: batch-of-one head-major.
LAYOUTS = ("nhd", "hnd", "bhnd")


def _layout_of(shape: tuple, nkv: int) -> str | None:
    """The layout a block's shape says (None: ambiguous, ``n == nkv > 1``)."""
    if len(shape) == 4:
        return "bhnd"
    if len(shape) == 3 and shape[0] == shape[1] == nkv and nkv > 1:
        return None
    if len(shape) == 3 and shape[0] == nkv:
        return "hnd"
    return "nhd"


def kv_layout(k, v, nkv: int, layout: str | None) -> str | None:
    """One layout for a K/V pair: the one given, or the one either shape
    says when the other is ambiguous (None when both are: float_block refuses)."""
    if layout is not None:
        return layout
    got = {_layout_of(tuple(np.shape(x)), nkv) for x in (k, v)} - {None}  # a torch.Size is a tuple
    return got.pop() if len(got) == 1 else None


def float_block(name: str, x, nkv: int, hd: int, layout: str | None = None) -> np.ndarray:
    """A block of ``n`` rows per head as float32 ``[n, nkv, hd]``: token-major
    (``"nhd"``: ``[n, nkv, hd]`` or ``[n, nkv*hd]``, made C-contiguous) or
    head-major (``"hnd"``: ``[nkv, n, hd]``; ``"bhnd"``: ``[1, nkv, n, hd]``,
    transformers' layout), returned as a transposed view: a C-contiguous
    head-major block is not copied, as storage is head-major too. ``layout``
    None reads the shape, and refuses a 3-D block whose first two axes are
    both ``nkv`` (``n == nkv > 1``: either layout fits) rather than guess."""
    a = _as_f32(name, x)
    if layout is None:
        layout = _layout_of(a.shape, nkv)
        if layout is None:
            raise ShapeError(f"{name} has shape {a.shape}: both [n, {nkv}, {hd}] (token-major) and "
                             f"[{nkv}, n, {hd}] (head-major) fit; pass layout='nhd' or layout='hnd'")
    elif layout not in LAYOUTS:
        raise ShapeError(f"layout must be one of {', '.join(LAYOUTS)} or None, got {layout!r}")
    if layout == "bhnd":
        if a.ndim != 4 or a.shape[0] != 1:
            raise ShapeError(f"{name} has shape {a.shape}; layout 'bhnd' is [1, {nkv}, n, {hd}] "
                             "(one sequence per layer cache)")
        a, layout = a[0], "hnd"
    if layout == "hnd":
        if a.ndim != 3 or a.shape[0] != nkv or a.shape[2] != hd:
            raise ShapeError(f"{name} has shape {a.shape}; expected head-major [{nkv}, n, {hd}]")
        return a.transpose(1, 0, 2)
    if a.ndim == 2 and a.shape[1] == nkv * hd:
        a = a.reshape(a.shape[0], nkv, hd)
    if a.ndim != 3 or a.shape[1:] != (nkv, hd):
        raise ShapeError(f"{name} has shape {a.shape}; expected [n, {nkv}, {hd}] or [n, {nkv * hd}]")
    return np.ascontiguousarray(a)


def flat(name: str, x) -> np.ndarray:
    """Any float array-like -> 1-D float32 (lists as float32 values)."""
    return _as_f32(name, x).ravel()


def gqa(num_heads, nkv: int) -> int:
    """``num_heads``: a positive multiple of ``nkv`` (the GQA fan-out divides)."""
    msg = f"num_heads={num_heads!r} must be a positive multiple of num_kv_heads={nkv}"
    if isinstance(num_heads, (bool, np.bool_)) or not isinstance(num_heads, (numbers.Integral, np.integer)):
        raise ShapeError(msg)
    n = operator.index(num_heads)
    if not 0 < n <= MAX_INT or n % nkv:
        raise ShapeError(msg)
    return n


def float_vector(name: str, x) -> np.ndarray:
    a = _as_f32(name, x)
    if a.ndim != 1:
        raise ShapeError(f"{name} has shape {a.shape}; expected a 1-D vector")
    return np.ascontiguousarray(a)


def alive_mask(alive, nkv: int) -> np.ndarray:
    """None/empty = every head alive (the seed: a missing entry is alive)."""
    if alive is None:
        return np.ones(nkv, dtype=bool)
    a = np.asarray(alive)
    if a.size == 0:
        return np.ones(nkv, dtype=bool)
    if a.dtype != bool or a.shape != (nkv,):
        raise ShapeError(f"alive has shape {a.shape} dtype {a.dtype}; expected {nkv} booleans (or None)")
    return a.copy()


def sinks(x, nheads: int) -> np.ndarray | None:
    if x is None:
        return None
    a = float_vector("sinks", x)
    if a.size == 0:
        return None
    if a.shape[0] != nheads:
        raise ShapeError(f"sinks has {a.shape[0]} logits; expected one per Q head ({nheads})")
    return a


def imp_acc(x) -> np.ndarray | None:
    if x is None:
        return None
    # Contiguous too: a compiled kernel writes through the raw buffer, so a
    # strided view would get its sums at the wrong addresses.
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 or not x.flags.writeable \
            or not x.flags.c_contiguous:
        raise ShapeError("imp_acc must be a writable, contiguous 1-D float32 numpy array "
                         "(it is accumulated in place)")
    return x


def _real(name: str, x, want: str) -> float:
    """A real number (Python, numpy, Fraction, Decimal...) as a float; bools
    and values no float holds are refused."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.floating, np.integer)):
        raise ShapeError(f"{name} must be {want}, got {x!r}")
    try:
        return float(x)
    except (OverflowError, ValueError, TypeError):
        raise ShapeError(f"{name} must be {want}, got {x!r}") from None


def real_at_least(name: str, x, lo: float) -> float:
    """A real number >= ``lo`` as a float (+inf allowed; NaN reads as +inf,
    as ``kv_abs_max`` reports a NaN row)."""
    f = _real(name, x, f"a number >= {lo}")
    if f != f:
        return float("inf")
    if not f >= lo:
        raise ShapeError(f"{name} must be a number >= {lo}, got {x!r}")
    return f


_F32_MAX = float(np.finfo(np.float32).max)


def scale(x) -> np.float32:
    """A positive score scale, finite in float32: the kernels multiply in
    float32, so 1e39 would become inf (and every score NaN), 1e-50 zero."""
    if type(x) is float:     # a float (every decode call): the scalar made once
        s = _SCALES.get(x)
        if s is not None:
            return s
    want = "a positive number, finite and non-zero in float32"
    f = x if type(x) is float else _real("scale", x, want)   # a float: no ABC checks
    # compared in Python first (no float32 overflow, no errstate: this runs per decode call)
    s = np.float32(f) if 0.0 < f <= _F32_MAX else np.float32(0.0)
    if not s > 0:
        raise ShapeError(f"scale must be {want}, got {x!r}")
    if type(x) is float and len(_SCALES) < 256:
        _SCALES[x] = s
    return s


#: float -> its checked float32 scale: a model has a few (numpy scalars cost
#: ~20 µs each inside a model, caches flushed).
_SCALES: dict[float, np.float32] = {}


def softcap(x) -> float:
    want = "a number >= 0 finite in float32 (0 = off)"
    f = x if type(x) is float else _real("softcap", x, want)
    if not 0.0 <= f <= _F32_MAX:
        raise ShapeError(f"softcap must be {want}, got {x!r}")
    return f
