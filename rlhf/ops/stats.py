"""Masked statistics over padded batches.

Every function takes a tensor ``x`` and a ``mask`` of the same shape (float or bool, 1 for real tokens, 0 for
padding). Padded positions never influence a result, even when they hold ``inf`` or ``NaN``: they are replaced
by zeros with ``torch.where`` before any arithmetic, so neither values nor gradients leak from them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(x * mask, mask)`` with ``mask`` cast to ``x.dtype`` and padded entries of ``x`` exactly zero."""
    m = mask.to(x.dtype)
    return torch.where(m != 0, x * m, torch.zeros_like(x)), m


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the real entries of ``x``, over all elements (``dim=None``) or along ``dim``.

    Shape: x and mask (b, t) or any shape; output () or x's shape without ``dim``.
    """
    xm, _ = _masked(x, mask)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask) / sum(mask)``, over all elements or along ``dim``; 0 (not NaN) where the mask sums to 0.

    Shape: x and mask (b, t) or any shape; output () or x's shape without ``dim``.
    """
    xm, m = _masked(x, mask)
    num = xm.sum() if dim is None else xm.sum(dim=dim)
    den = m.sum() if dim is None else m.sum(dim=dim)
    # divide by 1 where nothing is real: the numerator is 0 there, and no NaN reaches forward or backward
    return num / torch.where(den > 0, den, torch.ones_like(den))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the real entries of ``x`` over all elements.

    With ``unbiased`` and ``n > 1`` real entries the Bessel correction ``n / (n - 1)`` is applied; with ``n <= 1``
    the (biased) variance, 0, is returned.

    Shape: x and mask (b, t) or any shape; output ().
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        var = var * torch.where(n > 1, n / torch.where(n > 1, n - 1, torch.ones_like(n)), torch.ones_like(n))
    return var


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    restore_mean: bool = False,
    eps: float = 1e-8,
    moments: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Normalise the real entries of ``x`` to mean 0 and (unbiased) variance 1: ``(x - mean) * rsqrt(var + eps)``.

    With ``restore_mean=True`` the mean is added back afterwards, so only the scale is normalised (TRL's
    ``shift_mean=False``, used for reward whitening). Padded positions of the output are 0. ``moments`` is a
    (mean, unbiased variance) computed elsewhere, e.g. over the shards of every data-parallel process; None: those
    of ``x``'s real entries.

    Shape: x and mask (b, t); output (b, t).
    """
    if moments is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=True)
    else:
        mean, var = moments
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if restore_mean:
        whitened = whitened + mean
    return _masked(whitened, mask)[0]


def masked_quantiles(x: Tensor, mask: Tensor, qs: tuple[float, ...] = (0.05, 0.5, 0.95)) -> list[float]:
    """Quantiles ``qs`` of the real entries of ``x`` (``torch.quantile``, linear interpolation), as floats.

    An all-padding ``mask`` gives 0.0 for every quantile, like ``masked_mean``.

    Shape: x and mask (b, t) or any shape; output a list of ``len(qs)`` floats.
    """
    values = x.detach()[mask.bool()].to(torch.float64)
    if values.numel() == 0:
        return [0.0 for _ in qs]
    q = torch.tensor(qs, dtype=torch.float64, device=values.device)
    return [float(v) for v in torch.quantile(values, q, interpolation="linear")]


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Explained variance of the value predictions, ``1 - var(returns - values) / var(returns)``, masked.

    1 is a perfect critic, 0 no better than a constant, negative worse. Returns 0 when ``var(returns)`` is 0.

    Shape: values, returns and mask (b, t); output ().
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(returns - values, mask, unbiased=False)
    safe = torch.where(var_returns > 0, var_returns, torch.ones_like(var_returns))
    return torch.where(var_returns > 0, 1.0 - var_residual / safe, torch.zeros_like(var_returns))
