"""What a gradient travels as: Horovod's ``Compression`` (fp16, bf16) for ``DistributedOptimizer``."""

from __future__ import annotations

import torch

__all__ = ["Compression"]


class _NoneCompressor:
    """No compression: the gradient travels in its own dtype."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor:
    """Floating gradients travel as ``dtype`` and come back in their own; others are left alone."""

    dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.dtype:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class _FP16Compressor(_CastCompressor):
    """float16 on the wire (Horovod's ``Compression.fp16``): half the bytes, 11 significant bits, range 65504."""

    dtype = torch.float16


class _BF16Compressor(_CastCompressor):
    """bfloat16 on the wire: half the bytes, float32's range, 8 significant bits."""

    dtype = torch.bfloat16


class Compression:
    """Gradient compression for ``DistributedOptimizer(compression=...)``, in Horovod's shape.

    ``Compression.none`` (default), ``Compression.fp16``, ``Compression.bf16``.
    A compressor has ``compress(tensor) -> (wire_tensor, ctx)`` and
    ``decompress(wire_tensor, ctx) -> tensor``; any such object is accepted.
    """

    none = _NoneCompressor
    fp16 = _FP16Compressor
    bf16 = _BF16Compressor


def _compressor(compression):
    """None for no compression, else the compressor (checked for Horovod's two methods)."""
    if compression is None or compression is _NoneCompressor:
        return None
    if isinstance(compression, str):
        named = {"none": None, "fp16": _FP16Compressor, "float16": _FP16Compressor, "bf16": _BF16Compressor,
                 "bfloat16": _BF16Compressor}
        if compression not in named:
            raise ValueError(f"compression {compression!r}: expected one of {', '.join(named)} or a compressor")
        return named[compression]
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be Compression.none/fp16/bf16 or have compress() and decompress(), "
                        f"got {compression!r}")
    return compression


def _wire_dtype(compressor, p):
    """The dtype ``compressor`` sends a gradient of ``p`` in (it is asked with an empty tensor)."""
    out, _ = compressor.compress(torch.zeros(0, dtype=p.dtype, device=p.device))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"compression: compress() must return (tensor, ctx), got {type(out).__name__}")
    return out.dtype
