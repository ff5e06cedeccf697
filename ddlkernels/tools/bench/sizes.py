"""Sizes, types and collective names of a sweep, spelled as nccl-tests spells them on its command line.

Worked example::

    parse_size("64M")              -> 67108864          (binary units: K = 1024)
    format_size(67108864)          -> "64M"             (the inverse)
    sweep_sizes(4096, 16384, 2)    -> [4096, 8192, 16384]        (-b 4K -e 16K -f 2)
    sweep_sizes(0, 8, 1, step=4)   -> [0, 4, 8]                  (-f 1 -i 4: plus 4 bytes each)
    parse_dtype("float")           -> dtype('float32')  (nccl-tests' name; numpy's "float32" works too)
    nccl_type_name("float16")      -> "half"
    parse_dtype("uint8")           -> TypeError: ddlkernels does not reduce unsigned integers

``COLLECTIVES`` are the collectives a sweep can run (``--collective``).
"""

from __future__ import annotations

import re

import numpy as np

from ..._dtypes import check_dtype, dtype_name


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def parse_size(text) -> int:
    """"4K", "64M", "1G", "350MB", "123" -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?B?)\s*", str(text), re.I)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4K, 64M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    """Bytes -> the shortest exact "4K"/"64M"/"123" spelling (inverse of ``parse_size``)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


#: nccl-tests' type names (``-d``, and the "type" column) of the dtypes ddlkernels reduces, in nccl-tests'
#: order; numpy's names are accepted too.  ``-d float`` is float32, as in nccl-tests (numpy: float64).
NCCL_TYPES = {"int32": "int32", "int64": "int64", "half": "float16", "float": "float32", "double": "float64",
              "bfloat16": "bfloat16"}
_TYPE_ALIASES = {"float16": "float16", "float32": "float32", "float64": "float64", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32", "fp64": "float64"}
#: nccl-tests types that ddlkernels does not reduce, and why (refused, never mapped to something else).
NCCL_REFUSED = {"int8": "8-bit integers", "uint8": "unsigned integers", "uint32": "unsigned integers",
                "uint64": "unsigned integers", "f8e4m3": "8-bit floats", "f8e5m2": "8-bit floats",
                "char": "8-bit integers (nccl-tests' old name of int8)",
                "int": "an ambiguous name (nccl-tests' old int32, numpy's int64): say int32 or int64"}
_NCCL_NAME = {v: k for k, v in NCCL_TYPES.items()}


def parse_dtype(name) -> np.dtype:
    """A type name -> a dtype ddlkernels reduces: nccl-tests' ("float" = float32, "half", "double",
    "bfloat16", "int32", "int64") or numpy's ("float32", "float16", ...); ``TypeError`` otherwise."""
    if not isinstance(name, str):
        return check_dtype(np.dtype(name))
    key = name.strip().lower()
    canonical = NCCL_TYPES.get(key) or _TYPE_ALIASES.get(key)
    if canonical is None:
        supported = ", ".join(f"{k} ({v})" if k != v else k for k, v in NCCL_TYPES.items())
        why = NCCL_REFUSED.get(key)
        if why is not None:
            raise TypeError(f"type {name!r}: ddlkernels does not reduce {why}; supported: {supported}")
        raise TypeError(f"unknown type {name!r}; supported: {supported} (numpy's names work too)")
    if canonical == "bfloat16":
        import ml_dtypes

        return check_dtype(np.dtype(ml_dtypes.bfloat16))
    return check_dtype(np.dtype(canonical))


def nccl_type_name(dtype) -> str:
    """The name nccl-tests prints for a dtype ("float" for float32, "half", "double", ...)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return _NCCL_NAME.get(name, name)


def sweep_sizes(begin: int, end: int, factor: int, step: int | None = None) -> list[int]:
    """Sizes from ``begin`` to ``end``: times ``factor`` each (``factor`` >= 2), or, as nccl-tests does
    with ``-f 1``, plus ``step`` bytes each."""
    if begin < 0 or end < begin or factor < 1 or (factor == 1 and (step is None or step < 1)):
        raise ValueError("need 0 <= begin <= end, and factor >= 2, or factor 1 with a step >= 1")
    out, s = [], begin
    while s <= end:
        out.append(s)
        s = s + step if factor == 1 else (s * factor if s else 1)
    return out
