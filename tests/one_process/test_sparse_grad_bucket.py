"""A ``torch.sparse`` gradient's bucket (``SparseGradBucket``): what ``put`` makes of ``.grad``, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphddp.passes import Bucket, ParamSpec
from graphddp.runtime.buckets import SparseGradBucket


def sparse_grad(coalesced: bool) -> torch.Tensor:
    """An embedding's gradient, ``[6, 3]`` with rows 1 and 4 touched: row 1 twice when not coalesced."""
    values = torch.arange(9, dtype=torch.float32).view(3, 3)
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]), values, (6, 3))
    return grad.coalesce() if coalesced else grad


@pytest.mark.parametrize("scale", [None, 0.5])
@pytest.mark.parametrize("coalesced", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_holds_a_copy_of_the_gradient_in_the_buckets_dtype_made_once(
    dtype: torch.dtype, coalesced: bool, scale: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    param = nn.Parameter(torch.zeros(6, 3))
    bucket = SparseGradBucket(Bucket(0, (ParamSpec.of("emb.weight", param, sparse_grad=True, dtype=dtype),), 1024), [param], [0])
    grad = sparse_grad(coalesced)
    expected = grad.to_dense() * (scale or 1.0)
    clones = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: clones.append(self) or clone(self, *a, **k))

    bucket.put(grad, scale)

    assert bucket.buffer.dtype == dtype and bucket.buffer.is_coalesced()
    torch.testing.assert_close(bucket.buffer.to_dense(), expected.to(dtype))
    bucket.buffer._values().add_(100)  # the bucket's own: .grad is untouched
    torch.testing.assert_close(grad.to_dense() * (scale or 1.0), expected)
    # One copy: coalesce(), the cast or the scaling makes it; a clone only where none of them did.
    assert len(clones) == (1 if scale is None and coalesced and dtype == torch.float32 else 0), clones
