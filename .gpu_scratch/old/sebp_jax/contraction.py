"""Weight contractions as matrix products: when a ``dot_general`` or an einsum is ``(rows, K) @ (K, N)``.

A layer's contraction ``dot_general(x, w)`` with no batch dimensions is a matrix product after
transposes and reshapes: the rows are the flattened free (non-contracting) dimensions of ``x``,
``K`` its contracting dimensions, ``N`` the weight's free dimensions, which ``dot_general`` keeps in
the output after ``x``'s. ``Dense``, ``DenseGeneral`` / ``LinearGeneral`` (any ``axis``), the
projections of the attention modules and weight einsums such as ``BTD,DNH->BTNH`` or
``BTNH,NHD->BTD`` are all of this form, so one row-sparse backward serves them all.

Contractions with batch dimensions (attention scores ``bqhd,bkhd->bhqk``, batched matmuls, a
``DenseGeneral`` with ``batch_dims``) are not: their "rows" are per batch entry, and they stay
``lax.dot_general``.

This module is shape logic only; :class:`sebp_jax.matmul.SEBPDotGeneral` runs the product.
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["MatmulView", "matmul_view", "dense_reason", "einsum_dense_reason", "einsum_matmul",
           "DotGeneralEinsum"]


@dataclasses.dataclass(frozen=True)
class MatmulView:
  """How ``dot_general(lhs, rhs, dims)`` (no batch dims) is ``(rows..., K) @ (K, N)``.

  Attributes:
    lhs_perm: the transpose putting ``lhs``'s free dims first and its contracting dims last (in
      their order in ``lhs``); ``None`` where ``lhs`` already is in that order.
    rhs_perm: the transpose putting ``rhs``'s contracting dims first (in the order of their
      partners in ``lhs``) and its free dims last; ``None`` where already so, or where
      ``rhs_nk``.
    rows_shape: the sizes of ``lhs``'s free dims: the product's rows, unflattened.
    k: the product of the contracting sizes.
    n_shape: the sizes of ``rhs``'s free dims.
    rhs_nk: ``rhs`` is stored the other way round, its free dims first and its contracting dims
      last (``x @ w.T``: a tied output embedding, a PyTorch-layout weight). It is then viewed as
      ``(N, K)``, which the SEBP backward reads as it is (``sebp_matmul(transpose_kernel=True)``).
  """

  lhs_perm: tuple[int, ...] | None
  rhs_perm: tuple[int, ...] | None
  rows_shape: tuple[int, ...]
  k: int
  n_shape: tuple[int, ...]
  rhs_nk: bool = False

  def operands(self, lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x, w)``: ``x`` of shape ``(*rows_shape, K)`` (``(1, K)`` without free dims: rank >= 2)
    and ``w`` of shape ``(K, N)``, or ``(N, K)`` where ``rhs_nk``. Reshapes that only merge
    adjacent dims are free (bitcasts); a transpose happens only where ``lhs_perm`` /
    ``rhs_perm`` is not ``None``."""
    if self.lhs_perm is not None:
      lhs = jnp.transpose(lhs, self.lhs_perm)
    if self.rhs_perm is not None:
      rhs = jnp.transpose(rhs, self.rhs_perm)
    x_shape = (*self.rows_shape, self.k) if self.rows_shape else (1, self.k)
    x = lhs if lhs.shape == x_shape else lhs.reshape(x_shape)
    n = math.prod(self.n_shape)
    w_shape = (n, self.k) if self.rhs_nk else (self.k, n)
    w = rhs if rhs.shape == w_shape else rhs.reshape(w_shape)
    return x, w

  def result(self, y: jax.Array) -> jax.Array:
    """The ``(*rows_shape, N)`` product in ``dot_general``'s output shape: free dims of ``lhs``,
    then those of ``rhs``."""
    shape = (*self.rows_shape, *self.n_shape)
    return y if y.shape == shape else y.reshape(shape)


def _normalize(dims: Sequence[int], ndim: int) -> tuple[int, ...]:
  return tuple(d % ndim for d in dims)


def dense_reason(dimension_numbers) -> str | None:
  """Why a ``dot_general`` with these dimension numbers is not a weight matrix product, or
  ``None`` where it is one."""
  (_, _), (lhs_batch, rhs_batch) = dimension_numbers
  if tuple(lhs_batch) or tuple(rhs_batch):
    return "it has batch dimensions (a batched matmul)"
  return None


def matmul_view(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
                dimension_numbers) -> MatmulView | None:
  """The :class:`MatmulView` of ``dot_general(lhs, rhs, dimension_numbers)``, or ``None`` where
  the contraction has batch dimensions.

  >>> v = matmul_view((2, 7, 4, 8), (4, 8, 16), (((2, 3), (0, 1)), ((), ())))  # BTNH,NHD->BTD
  >>> v.lhs_perm, v.rhs_perm, v.rows_shape, v.k, v.n_shape
  (None, None, (2, 7), 32, (16,))
  >>> v = matmul_view((2, 7, 3), (5, 3), (((2,), (1,)), ((), ())))   # x @ w.T
  >>> v.rhs_perm, v.rhs_nk
  (None, True)
  """
  if dense_reason(dimension_numbers) is not None:
    return None
  (lhs_contract, rhs_contract), _ = dimension_numbers
  # The contracted pairs may be taken in any order: in `lhs`'s, which keeps the activation
  # untransposed whenever its contracted dims are its last ones (jnp.einsum lists them sorted by
  # letter, which need not be their order in either operand).
  pairs = sorted(zip(_normalize(lhs_contract, len(lhs_shape)),
                     _normalize(rhs_contract, len(rhs_shape))))
  lhs_contract = tuple(l for l, _ in pairs)
  rhs_contract = tuple(r for _, r in pairs)
  lhs_free = tuple(d for d in range(len(lhs_shape)) if d not in lhs_contract)
  rhs_free = tuple(d for d in range(len(rhs_shape)) if d not in rhs_contract)
  identity = lambda perm: None if perm == tuple(range(len(perm))) else perm  # noqa: E731
  rhs_perm = identity(rhs_contract + rhs_free)
  # Stored (free..., contracting...): viewed as (N, K) as it is, rather than transposed.
  rhs_nk = rhs_perm is not None and identity(rhs_free + rhs_contract) is None
  return MatmulView(
    lhs_perm=identity(lhs_free + lhs_contract),
    rhs_perm=None if rhs_nk else rhs_perm,
    rows_shape=tuple(lhs_shape[d] for d in lhs_free),
    k=math.prod(lhs_shape[d] for d in lhs_contract),
    n_shape=tuple(rhs_shape[d] for d in rhs_free),
    rhs_nk=rhs_nk,
  )


# --- einsums of an input and a weight ----------------------------------------------------------

def _parse(einsum_str: str) -> tuple[str, str, str]:
  einsum_str = einsum_str.replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(
      f"`einsum_str` must be explicit with two operands, 'lhs,rhs->out', got {einsum_str!r}.")
  inputs, out = einsum_str.split("->")
  lhs, rhs = inputs.split(",")
  return lhs, rhs, out


def einsum_dense_reason(einsum_str: str) -> str | None:
  """Why ``jnp.einsum(einsum_str, inputs, kernel)`` is not a weight matrix product, or ``None``
  where it is one.

  It is one unless a letter is shared by the input, the kernel and the output (a batch
  dimension), or the input or the kernel keeps no dimension in the output (a matrix-vector
  product, whose "rows" are not the input's), or a letter repeats within an operand (a
  diagonal). Letters of one operand that the output drops are fine: they are summed out first.

  >>> einsum_dense_reason("BTD,DNH->BTNH") is None, einsum_dense_reason("...F,NHF->...NH") is None
  (True, True)
  >>> einsum_dense_reason("BNTH,NHD->BNTD")
  "letter(s) 'N' index the input, the kernel and the output: a batched matmul"
  """
  lhs, rhs, out = _parse(einsum_str)
  if "..." in rhs:
    return "the kernel has an ellipsis"
  lhs_letters, rhs_letters = set(lhs.replace("...", "")), set(rhs)
  out_letters = set(out.replace("...", ""))
  batch = sorted(lhs_letters & rhs_letters & out_letters)
  if batch:
    return (f"letter(s) {''.join(batch)!r} index the input, the kernel and the output: a "
            "batched matmul")
  if not rhs_letters & out_letters:
    return "the kernel keeps no dimension in the output (a matrix-vector product)"
  if not (lhs_letters & out_letters or "..." in lhs):
    return "the input keeps no dimension in the output"
  for operand in (lhs.replace("...", ""), rhs):
    if len(set(operand)) != len(operand):
      return f"a letter repeats in {operand!r} (a diagonal)"
  return None


def _expand_ellipsis(einsum_str: str, lhs_ndim: int) -> tuple[str, str, str]:
  """``lhs``, ``rhs`` and ``out`` with ``...`` spelt out as letters unused by the equation."""
  lhs, rhs, out = _parse(einsum_str)
  if "..." not in lhs:
    return lhs, rhs, out
  free = [c for c in string.ascii_letters if c not in lhs + rhs + out]
  letters = "".join(free[:lhs_ndim - (len(lhs) - 3)])
  return lhs.replace("...", letters), rhs, out.replace("...", letters)


def einsum_matmul(
  einsum_str: str,
  inputs: jax.Array,
  kernel: jax.Array,
  *,
  dot_general: Callable[..., jax.Array],
  precision: Any = None,
  preferred_element_type: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  """``jnp.einsum(einsum_str, inputs, kernel)`` as one ``dot_general(inputs, kernel, dims)``.

  The input is always ``lhs`` (``jnp.einsum`` would contract ``kernel . inputs`` where the output
  lists the kernel's letters first, making the kernel's dims the product's rows), contracted
  letters are paired in the input's order (so an input with them last needs no transpose), and
  the product is transposed to the requested output order after. Letters of one operand that
  the output drops are summed out first. Einsums that are not weight matrix products
  (:func:`einsum_dense_reason`) are plain ``jnp.einsum``.
  """
  if einsum_dense_reason(einsum_str) is not None:
    return jnp.einsum(einsum_str, inputs, kernel, precision=precision,
                      preferred_element_type=preferred_element_type, out_sharding=out_sharding)
  lhs, rhs, out = _expand_ellipsis(einsum_str, inputs.ndim)
  inputs, lhs = _sum_out(inputs, lhs, keep=rhs + out)
  kernel, rhs = _sum_out(kernel, rhs, keep=lhs + out)
  contracted = [c for c in lhs if c in rhs]
  dims = ((tuple(lhs.index(c) for c in contracted), tuple(rhs.index(c) for c in contracted)),
          ((), ()))
  y = dot_general(inputs, kernel, dims, precision=precision,
                  preferred_element_type=preferred_element_type)
  product = [c for c in lhs if c not in contracted] + [c for c in rhs if c not in contracted]
  if product != list(out):
    y = jnp.transpose(y, tuple(product.index(c) for c in out))
  if out_sharding is not None:
    y = jax.sharding.reshard(y, out_sharding)
  return y


def _sum_out(operand: jax.Array, letters: str, keep: str) -> tuple[jax.Array, str]:
  """``operand`` summed over its letters not in ``keep``, and its remaining letters."""
  axes = tuple(i for i, c in enumerate(letters) if c not in keep)
  if not axes:
    return operand, letters
  return jnp.sum(operand, axis=axes), "".join(c for c in letters if c in keep)


@dataclasses.dataclass(frozen=True)
class DotGeneralEinsum:
  """A ``jnp.einsum`` replacement (``nnx.Einsum``'s ``einsum_op``) running weight einsums through
  ``dot_general`` (:func:`einsum_matmul`)."""

  dot_general: Callable[..., jax.Array]

  def __call__(self, einsum_str, inputs, kernel, *, precision=None, preferred_element_type=None,
               out_sharding=None):
    return einsum_matmul(einsum_str, inputs, kernel, dot_general=self.dot_general,
                         precision=precision, preferred_element_type=preferred_element_type,
                         out_sharding=out_sharding)
