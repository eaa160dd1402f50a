"""Thread-count-independent results for the few torch kernels whose float result depends on the thread count.

Most torch CPU kernels give the same bits at any intra-op thread count: element-wise ops, reductions with more than
one output element (each output is reduced by one thread, in one order), and the GEMMs quantopt calls. Three kinds
do not: a float reduction to a single element over more than 32768 values (`sum`, `mean`, `var`, `std_mean`,
`prod`, ...: ATen then sums one partial result per thread), BLAS level-1 dot products (`torch.dot`), and LAPACK
factorizations (`cholesky`, `cholesky_inverse`, `eigh`, `svd`). quantopt runs those under `one_thread()`, so they
compute exactly what they compute on one thread, whatever `torch.set_num_threads` / OMP_NUM_THREADS /
MKL_NUM_THREADS say (docs/architecture.md, "Float reference"; tests/test_threads.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def one_thread(when: bool = True) -> Iterator[None]:
    """Run the block on one intra-op thread (torch's and MKL's), restoring the previous count after it; nothing
    changes when `when` is false or only one thread is in use."""
    threads = torch.get_num_threads()
    if not when or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
