"""Reading jaxprs in tests: which primitives a traced program really runs."""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["iter_eqns", "dot_output_shapes", "count_primitive", "count_sebp_rules"]


def iter_eqns(jaxpr: Any, *, into_kernels: bool = True) -> Iterator[Any]:
  """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) and of the jaxprs nested in
  its equations' parameters (``pjit``, ``cond`` branches, ``scan`` bodies, custom rules...);
  without ``into_kernels``, not those of Pallas kernel bodies (the program around them only)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    if not into_kernels and eqn.primitive.name == "pallas_call":
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          yield from iter_eqns(sub, into_kernels=into_kernels)


def dot_output_shapes(jaxpr: Any) -> list[tuple[int, ...]]:
  """Output shapes of every ``dot_general`` that ``jaxpr`` runs."""
  return [tuple(e.outvars[0].aval.shape) for e in iter_eqns(jaxpr)
          if e.primitive.name == "dot_general"]


def count_primitive(jaxpr: Any, prefix: str, *, into_kernels: bool = True) -> int:
  """How many equations run a primitive whose name starts with ``prefix``; without
  ``into_kernels``, in the program around Pallas kernels only (a kernel's ``pl.when`` is a
  ``cond`` too, not one of the program's conditionals)."""
  return sum(e.primitive.name.startswith(prefix)
             for e in iter_eqns(jaxpr, into_kernels=into_kernels))


def count_sebp_rules(jaxpr: Any) -> int:
  """How many layers ``jaxpr`` runs through an SEBP backward rule: one per ``sebp_matmul`` rule
  (``custom_vjp``), one per product of a ``sebp_matmuls`` rule (a sibling group, or one layer
  made a group of one); other ``custom_vjp``s (an embedding's, say) not counted."""
  def layers(eqn) -> int:
    rule = getattr(eqn.params.get("bwd"), "__name__", "")
    if not eqn.primitive.name.startswith("custom_vjp_call"):
      return 0
    return 1 if rule.startswith("_sebp_product") else (
      len(eqn.outvars) if rule.startswith("_sebp_siblings") else 0)
  return sum(layers(e) for e in iter_eqns(jaxpr))
