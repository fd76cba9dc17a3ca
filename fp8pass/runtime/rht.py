"""Random Hadamard transform (RHT) of weight-gradient GEMM operands, 16x16 along the token dim.

``R = H16 diag(s) / 4`` with ``H16`` the Sylvester Hadamard matrix and ``s`` random signs drawn from a
fixed seed (the same for every layer). ``R`` is orthogonal (``R^T R = I``), so transforming both
operands of ``dW = dY^T X`` in 16-token groups leaves the product unchanged in exact arithmetic::

    sum_g (R dY_g)^T (R X_g) = sum_g dY_g^T R^T R X_g = dY^T X

while spreading a token outlier over its 16-token group before the 1x16 NVFP4 blocks are formed.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["RHT_SIZE", "hadamard_matrix", "rht_last_dim", "pad_last_dim"]

RHT_SIZE = 16


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (RHT_SIZE,), generator=gen, dtype=torch.int64) * 2 - 1
    return (h * signs.to(torch.float64)[None, :] / RHT_SIZE ** 0.5).to(torch.float32)


def hadamard_matrix(seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 16x16 orthogonal matrix ``H16 diag(s) / 4`` (entries +-1/4, exact in fp32)."""
    return _hadamard_cpu(int(seed)).to(device)


def pad_last_dim(x: torch.Tensor, multiple: int = RHT_SIZE) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of ``multiple`` (zero tokens add nothing to ``dY^T X``)."""
    pad = (-x.shape[-1]) % multiple
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad))


def rht_last_dim(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``R`` applied to every 16-group of ``x``'s last dim (padded with zeros), in fp32.

    Args:
        x: ``[rows, tokens]``: a wgrad operand transposed so the tokens (the reduction dim) are last.
        seed: the sign seed.
    """
    xp = pad_last_dim(x.to(torch.float32))
    r = hadamard_matrix(seed, x.device)
    rows, t = xp.shape
    return (xp.reshape(rows, t // RHT_SIZE, RHT_SIZE) @ r.t()).reshape(rows, t)
