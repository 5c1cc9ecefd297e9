"""The routing table: where every param went (Muon with its view / AdamW / frozen) and what decided
it, and the fail-closed checks on the policy (pure).

:func:`routing_table` is what ``dedicate_params`` computes from the model's named params, the
predicate and the :class:`~dmuon.functional.policy.ParamPolicy` (``dmuon.dedicate_params(...)
.routing``, ``dmuon.Muon.routing_table()``; ``str()`` prints it). It raises ``ValueError`` (every
rank computes the same, from the same model and policy):

* a rule that matches no param (unless ``Rule(optional=True)``: ``hf_rules`` marks its generic
  rules so, as a config's fused-projection rules find nothing in a model without them);
* a rule that matches params but none first (an earlier rule decides each of them: it would
  decide nothing), unless ``optional``;
* a rule that sets a view but matches no Muon param (the view would be ignored);
* a param the policy says is Muon-eligible that ends on AdamW: one whose first matching rule sets
  a view (a declared matrix structure), or one ``ParamPolicy(eligible=...)`` accepts, unless a rule
  routes it to AdamW explicitly (``Rule(pattern, route="adamw")``: the opt-out).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from dmuon.functional.module_routes import module_notes, module_reasons, off_muon, param_uses
from dmuon.functional.policy import Decision, ParamPolicy

__all__ = ["Route", "RoutingTable", "routing_table", "model_routing_table", "Dedication"]


class Route(NamedTuple):
    """One param's row: ``name``, ``shape``, ``route`` (``"muon"`` / ``"adamw"`` / ``"frozen"``),
    ``view`` (Muon: its matrix view), ``decided_by`` (the rule, the predicate, the view's source),
    ``owner`` (Muon: the owner's global rank, once planned)."""

    name: str
    shape: tuple
    route: str
    view: Optional[str]
    decided_by: str
    owner: Optional[int] = None


class RoutingTable(NamedTuple):
    """Every param's :class:`Route`, in ``named_parameters`` order; ``notes``: the warnings about
    the routing ``dedicate_params`` logs (:mod:`dmuon.functional.module_routes`)."""

    rows: tuple
    notes: tuple = ()

    def of(self, route: str) -> list[str]:
        """The names routed ``route``."""
        return [r.name for r in self.rows if r.route == route]

    def with_owners(self, owners: dict) -> "RoutingTable":
        return self._replace(rows=tuple(r._replace(owner=owners.get(r.name)) for r in self.rows))

    def __str__(self) -> str:
        counts = {k: len(self.of(k)) for k in ("muon", "adamw", "frozen")}
        head = ("dmuon routing: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        cols = [("param", [r.name for r in self.rows]),
                ("shape", ["x".join(map(str, r.shape)) or "()" for r in self.rows]),
                ("route", [r.route for r in self.rows]),
                ("view", [r.view or "-" for r in self.rows]),
                ("owner", ["-" if r.owner is None else str(r.owner) for r in self.rows]),
                ("decided by", [r.decided_by for r in self.rows])]
        widths = [max([len(h)] + [len(v) for v in vals]) for h, vals in cols]
        lines = [head, "  ".join(h.ljust(w) for (h, _), w in zip(cols, widths))]
        for i in range(len(self.rows)):
            lines.append("  ".join(vals[i].ljust(w) for (_, vals), w in zip(cols, widths)).rstrip())
        return "\n".join(lines)


def routing_table(named: Iterable[tuple[str, Sequence[int], bool]], policy: ParamPolicy,
                  decisions: dict[str, Decision], reasons: Optional[Mapping[str, str]] = None,
                  notes: tuple = ()) -> RoutingTable:
    """The table, and the checks of the module docstring.

    Args:
      named: ``(name, shape, requires_grad)`` of every param (tied params once).
      policy: the policy.
      decisions: ``{name: Decision}`` of the Muon params (``ParamPolicy.decide``'s).
      reasons: ``{name: text}`` said instead of ``"predicate"`` where the predicate decided.
      notes: the table's :attr:`RoutingTable.notes`.
    """
    reasons = reasons or {}
    named = [(n, tuple(int(d) for d in s), bool(g)) for n, s, g in named]
    rows = []
    for n, shape, trainable in named:
        if not trainable:
            rows.append(Route(n, shape, "frozen", None, "requires_grad=False"))
            continue
        k, r = policy.rule_for(n)
        by_rule = r is not None and r.route is not None
        route_by = f"rule {k} ({r.pattern})" if by_rule else reasons.get(n, "predicate")
        if n in decisions:
            d = decisions[n]
            view_by = d.source if d.source.startswith("rule") else f"{d.source} view"
            rows.append(Route(n, shape, "muon", str(d.view), f"{route_by}; {view_by}"))
        else:
            rows.append(Route(n, shape, "adamw", None, route_by))
    table = RoutingTable(tuple(rows), tuple(notes))
    _check(table, named, policy)
    return table


def model_routing_table(model: Any, policy: ParamPolicy, decisions: dict[str, Decision],
                        predicate: Any) -> RoutingTable:
    """:func:`routing_table` of the ``nn.Module`` ``model`` routed by ``predicate`` and ``policy``,
    whose reasons and notes say where the module mattered
    (:mod:`dmuon.functional.module_routes`; a route a rule sets is the rule's)."""
    named = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    off = {n: o for n, o in off_muon(param_uses(model)).items()
           if policy.rule_for(n)[1] is None or policy.rule_for(n)[1].route is None}
    return routing_table(named, policy, decisions, module_reasons(predicate, off, decisions),
                         module_notes(predicate, off, decisions))


def _check(table: RoutingTable, named: list, policy: ParamPolicy) -> None:
    names = [n for n, _, _ in named]
    routed = {r.name: r.route for r in table.rows}
    for k, r in enumerate(policy.rules):
        hits = [n for n in names if r.matches(n)]
        if not hits and not r.optional:
            near = [n for n in names if n.rsplit(".", 1)[-1] == r.pattern.rsplit(".", 1)[-1]]
            raise ValueError(
                f"policy rule {k} ({r.pattern!r}) matches no param of the model; a rule that "
                f"matches nothing is a typo or a stale name. Params look like "
                f"{(near or names)[:4]}. Fix the pattern, or drop the rule (Rule(..., "
                "optional=True) for a rule meant to match only in some models).")
        first = sorted({policy.rule_for(n)[0] for n in hits})
        if hits and not r.optional and k not in first:
            raise ValueError(
                f"policy rule {k} ({r.pattern!r}) matches {hits[:4]}, but an earlier rule "
                f"matches each of them first (rule(s) {first}: the first matching rule decides a "
                "param's route, view, multipliers and dtypes, whole), so this rule decides "
                "nothing. Put it before the rule(s) it should override (and repeat there what it "
                "should keep), or drop it.")
        if r.view is not None and hits and not any(routed[n] == "muon" for n in hits):
            raise ValueError(
                f"policy rule {k} ({r.pattern!r}) sets the view {r.view}, but every param it "
                f"matches goes to AdamW or is frozen ({hits[:4]}): the view would be ignored. "
                "Route them to Muon (predicate, or route='muon'), or drop the view.")
    lost = []
    for n, shape, trainable in named:
        if not trainable or routed[n] != "adamw":
            continue
        k, r = policy.rule_for(n)
        if r is not None and r.route == "adamw":
            continue  # opted out explicitly
        declared = r is not None and r.view is not None
        if declared or (policy.eligible is not None and policy.eligible(n, shape)):
            lost.append((n, "its rule declares a view" if declared else "policy.eligible"))
    if lost:
        raise ValueError(
            f"{len(lost)} param(s) the policy says are Muon matrices end on AdamW: "
            + ", ".join(f"{n!r} ({why})" for n, why in lost[:4])
            + ". The predicate rejected them (a name it does not know? a check on ndim?). Route "
            "them to Muon (predicate, or Rule(pattern, route='muon')), or opt out explicitly: "
            "Rule(pattern, route='adamw') before the rule that matches them.")


class Dedication(dict):
    """``dedicate_params``' return value: ``{param: owner global rank}`` (a dict, as before) with
    the :class:`RoutingTable` as ``.routing`` (``None`` while a dedication is deferred)."""

    routing: Optional[RoutingTable] = None
