"""Element types and reduction operators: the one table every layer consults.

Accumulation rule (documented in the README): every pairwise combination is
computed in the *accumulation type* and rounded once to the storage type.
float16 and bfloat16 accumulate in float32, everything else in itself.  A
sum over p ranks therefore rounds p - 1 times in the storage type -- the same
rule as NCCL -- and the wire carries storage-type data only, so fp16
gradients cost half the bandwidth of fp32 ones.

"avg" is the sum followed by a scale applied once, by the rank that owns the
shard, fused into its last reduction step: ``round((a + b) * (1/p))`` with the
product taken in the accumulation type for floats, and ``floor((a + b) / p)``
(Python's ``//``) for integers, so an integer average stays an integer and is
exact when the sum is divisible by p.
"""

from __future__ import annotations

import numpy as np

try:  # bfloat16 is optional at import time; the error is raised on use.
    import ml_dtypes as _ml_dtypes

    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency in setup.py
    _ml_dtypes = None
    BFLOAT16 = None

__all__ = ["OPS", "SUPPORTED_DTYPES", "normalize_op", "check_dtype", "acc_dtype", "dtype_name", "is_half",
           "scale_inplace"]

#: The reduction operators, by name.  "avg" reduces as "sum" then scales.
OPS = ("sum", "avg", "max", "min", "prod")

SUPPORTED_DTYPES = tuple(
    d
    for d in (
        np.dtype(np.float16),
        BFLOAT16,
        np.dtype(np.float32),
        np.dtype(np.float64),
        np.dtype(np.int32),
        np.dtype(np.int64),
    )
    if d is not None
)


_OP_NAMES = {name: name for name in OPS}


_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
_HALF_SET = frozenset(d for d in (np.dtype(np.float16), BFLOAT16) if d is not None)


def is_half(dt) -> bool:
    """float16 or bfloat16: stored in 16 bits, accumulated in float32 (see the module docstring)."""
    return dt in _HALF_SET


def dtype_name(dt) -> str:
    return "bfloat16" if BFLOAT16 is not None and np.dtype(dt) == BFLOAT16 else np.dtype(dt).name


#: ``torch.distributed.ReduceOp`` members, by name, that have an op here.
_TORCH_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min", "PRODUCT": "prod"}


def normalize_op(op) -> str:
    """Map ``op`` (a name, ``MPI.SUM``/``MAX``/``MIN``/``PROD`` or ``torch.distributed.ReduceOp.*``) to one of ``OPS``."""
    if isinstance(op, str):
        fast = _OP_NAMES.get(op)
        if fast is not None:
            return fast
        name = op.lower()
        if name in OPS:
            return name
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)} or MPI.SUM/MAX/MIN/PROD")
    if type(op).__module__.startswith("torch"):
        return _torch_op(op)
    from mpi4py import MPI

    if isinstance(op, MPI.Op):  # mpi4py ops are not hashable: compare one by one
        for mpi_op, name in ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.MIN, "min"), (MPI.PROD, "prod")):
            if op == mpi_op:
                return name
    raise ValueError(f"unsupported op {op!r}; expected one of {', '.join(OPS)} or MPI.SUM/MAX/MIN/PROD")


def _torch_op(op) -> str:
    """``torch.distributed.ReduceOp.SUM`` (a ``RedOpType``) or a ``ReduceOp`` holding one -> its name here."""
    kind = getattr(op, "op", op)  # a ReduceOp instance holds its RedOpType in .op
    name = getattr(kind, "name", None)
    if name in _TORCH_OPS:
        return _TORCH_OPS[name]
    raise ValueError(
        f"unsupported op {op!r}: ddlkernels reduces with torch.distributed.ReduceOp SUM, AVG, MAX, MIN and "
        f"PRODUCT (not the bitwise ones or PREMUL_SUM)"
    )


def check_dtype(dt) -> np.dtype:
    """Return ``np.dtype(dt)`` if ddlkernels can reduce it, else raise ``TypeError``."""
    if dt in _SUPPORTED_SET:  # np.dtype hashes fast; this is every call's path
        return dt
    try:
        dt = np.dtype(dt)
    except TypeError:
        raise TypeError(f"unsupported dtype {dt!r}") from None
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        raise TypeError(f"unsupported dtype {dt}: only native little-endian data is reduced")
    if dt not in SUPPORTED_DTYPES:
        names = ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported dtype {dtype_name(dt)}; supported: {names}")
    return dt


def acc_dtype(dt) -> np.dtype:
    """The type pairwise reductions are computed in (see the module docstring)."""
    dt = np.dtype(dt)
    if is_half(dt):
        return np.dtype(np.float32)
    return dt


def scale_inplace(dst, p) -> None:
    """``dst`` (a host array) scaled for "avg" once the sum is done: ``floor(dst / p)`` for integers,
    ``dst * (1/p)`` with the product in the accumulation type for floats (the module docstring)."""
    if dst.dtype.kind in "iu":
        np.floor_divide(dst, dst.dtype.type(p), out=dst)
    else:
        np.multiply(dst, acc_dtype(dst.dtype).type(1.0 / p), out=dst, casting="unsafe")
