"""Packing gradients into a fusion buffer and back (``ddlkernels.fusion``), against one copy of the same bytes.

A model's gradients are many tensors; tensor fusion copies them into one
buffer, reduces it with one collective, and copies the slices back.  These
copies are pure memory traffic: 2 x bytes each way (read + write), compared
in the summary with a single ``np.copyto`` of the same total size.  The
tensor list is a ResNet-50-shaped set of layers at half width (161 tensors,
about 6.4 M float32 = 25 MB: many small BN vectors, a few large convolutions),
so per-tensor overhead and bandwidth both show.

Skipped cleanly when ``ddlkernels.fusion`` is not part of the installed package.
"""

import numpy as np
import pytest

fusion = pytest.importorskip("ddlkernels.fusion", reason="ddlkernels.fusion (tensor fusion) is not available")


def _resnet50_half():
    """Shapes of a ResNet-50 at half width: conv weights plus BN gamma/beta per layer, then the classifier."""
    shapes = [(32, 3, 7, 7), (32,), (32,)]
    cin = 32
    for width, blocks in ((32, 3), (64, 4), (128, 6), (256, 3)):
        for blk in range(blocks):
            for cout, k in ((width, 1), (width, 3), (width * 4, 1)):
                shapes += [(cout, cin, k, k), (cout,), (cout,)]
                cin = cout
            if blk == 0:
                shapes += [(width * 4, width * 4 // (2 if width > 32 else 1), 1, 1), (width * 4,), (width * 4,)]
    shapes += [(500, cin), (500,)]
    return shapes


@pytest.fixture(scope="module")
def job():
    rng = np.random.default_rng(3)
    tensors = [rng.integers(-8, 9, s).astype(np.float32) for s in _resnet50_half()]
    j = fusion.FusionJob(tensors, "sum")
    assert len(j.buckets) == 1, "the default fusion size holds the whole model in one bucket"
    bucket = j.buckets[0]
    buf = np.empty(bucket.count, np.float32)
    return j, bucket, buf, sum(t.nbytes for t in tensors)


def bench_pack(benchmark, run, job):
    j, bucket, buf, nbytes = job
    benchmark.group = "pack"
    run(benchmark, j.pack, bucket, buf, nbytes=2 * nbytes, key=("pack", f"{len(j.tensors)} tensors", "float32"))
    for e in bucket.entries:  # every tensor at its offset
        assert np.array_equal(buf[e.offset:e.offset + e.count], j.tensors[e.index].reshape(-1))


def bench_unpack(benchmark, run, job):
    j, bucket, buf, nbytes = job
    j.pack(bucket, buf)
    benchmark.group = "pack"
    run(benchmark, j.unpack, bucket, buf, nbytes=2 * nbytes, key=("unpack", f"{len(j.tensors)} tensors", "float32"))
    for e in bucket.entries:
        assert np.array_equal(j.outs[e.index], j.tensors[e.index])


def bench_pack_copy_reference(benchmark, run, job):
    """One ``np.copyto`` of the same number of bytes: what packing would cost with no per-tensor overhead."""
    j, bucket, buf, nbytes = job
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    benchmark.group = "pack"
    run(benchmark, np.copyto, dst, src, nbytes=2 * nbytes, key=("copy", f"{len(j.tensors)} tensors", "float32"))
