"""The rewrite engine: rules declared as data, matched on the IR, applied to a fixpoint.

A Rule is (name, pattern, condition, replacement). A pattern is a tree of ``P`` (an op, its
inputs by argument name) whose leaves are ``V`` (any value, captured by name). The engine finds
a match rooted at a node, checks the rule's named condition, asks the replacement for new nodes,
splices them in where the root was, and redirects the root's users to the new result. Interior
nodes of a match must have no users outside it (else they stay and the rule does not fire).
Dead nodes are swept at the end. Rules never register themselves: rule sets are module-level
tuples (``rules_<purpose>``) that a pass hands to ``apply_rules``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cuvil.ir import Arg, Graph, Node, Value, map_values
from cuvil.passes.dead_code import eliminate_dead_code
from cuvil.passes.program import NameSource, Program


@dataclass(frozen=True)
class V:
    """Matches any value; captured under ``name``."""

    name: str


@dataclass(frozen=True)
class L:
    """Matches any literal argument (not a value); captured under ``name``."""

    name: str


@dataclass(frozen=True)
class P:
    """Matches a node whose op is one of ``ops`` and whose named arguments match."""

    ops: str | tuple[str, ...]
    args: Mapping[str, P | V | L | Any] = field(default_factory=dict)
    name: str | None = None  # capture the node itself

    def op_set(self) -> tuple[str, ...]:
        return (self.ops,) if isinstance(self.ops, str) else self.ops


@dataclass
class Match:
    root: Node
    nodes: dict[str, Node]  # captured nodes by pattern name
    values: dict[str, Value]  # captured values by V name
    literals: dict[str, Any]  # captured literals by L name
    interior: list[Node]  # every matched node except the root
    program: Program
    users: Mapping[str, list[Node]] = field(default_factory=dict)

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def const(self, name: str) -> torch.Tensor | None:
        return self.program.const_tensor(self.values[name])


@dataclass
class Rewriter:
    """What a replacement uses to build nodes: fresh names and new weights."""

    names: NameSource
    new_weights: dict[str, torch.Tensor]

    def weight(self, base: str, tensor: torch.Tensor) -> str:
        key = self.names.fresh(base)
        self.new_weights[key] = tensor.detach().contiguous()
        return key


# A replacement returns the new nodes (the last one's first output replaces the root's value,
# or an explicit mapping old value -> new value), or None to decline.
Replacement = Callable[
    [Match, Rewriter], "list[Node] | tuple[list[Node], dict[Value, Value]] | None"
]
Condition = Callable[[Match], bool]


def always(match: Match) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: P
    replacement: Replacement
    condition: Condition = always


def _match(
    pattern: P | V | Any, arg: Arg, graph: Graph, found: Match, users: Mapping[str, list[Node]]
) -> bool:
    if isinstance(pattern, V):
        if not isinstance(arg, Value):
            return False
        previous = found.values.setdefault(pattern.name, arg)
        return previous == arg
    if isinstance(pattern, L):
        if isinstance(arg, Value) or (
            isinstance(arg, tuple) and any(isinstance(a, Value) for a in arg)
        ):
            return False
        found.literals[pattern.name] = arg
        return True
    if isinstance(pattern, tuple):
        if not isinstance(arg, tuple) or len(arg) != len(pattern):
            return False
        return all(_match(p, a, graph, found, users) for p, a in zip(pattern, arg, strict=True))
    if not isinstance(pattern, P):
        return bool(pattern == arg)
    if not isinstance(arg, Value) or arg.index != 0:
        return False
    node = graph.by_name[arg.node]
    if not _match_node(pattern, node, graph, found, users):
        return False
    found.interior.append(node)
    return True


def _match_node(
    pattern: P, node: Node, graph: Graph, found: Match, users: Mapping[str, list[Node]]
) -> bool:
    if node.op not in pattern.op_set():
        return False
    for key, sub in pattern.args.items():
        if not _match(sub, node.arg(key), graph, found, users):
            return False
    if pattern.name is not None:
        found.nodes[pattern.name] = node
    return True


def find_match(
    rule: Rule, node: Node, program: Program, users: Mapping[str, list[Node]]
) -> Match | None:
    found = Match(node, {}, {}, {}, [], program, users)
    if not _match_node(rule.pattern, node, program.graph, found, users):
        return None
    matched = {n.name for n in found.interior} | {node.name}
    for inner in found.interior:  # interior values must not escape the match
        if any(user.name not in matched for user in users[inner.name]):
            return None
        if any(value.node == inner.name for _, value in program.graph.outputs):
            return None
    return found if rule.condition(found) else None


def apply_rules(program: Program, rules: Iterable[Rule], max_rounds: int = 20) -> Program:
    """Apply ``rules`` until none fires (or ``max_rounds``); returns the new program with hits."""
    rules = tuple(rules)
    hits = {rule.name: 0 for rule in rules}
    for _ in range(max_rounds):
        program, fired = _one_round(program, rules, hits)
        if not fired:
            break
    return program.with_hits(hits)


def _one_round(
    program: Program, rules: tuple[Rule, ...], hits: dict[str, int]
) -> tuple[Program, bool]:
    """Choose matches consumers-first (so the largest pattern at the end of a chain wins), then
    rebuild producers-first, re-matching each chosen root on the graph as rewritten so far."""
    graph = program.graph
    users = graph.users()
    chosen: dict[str, Rule] = {}
    claimed: set[str] = set()
    for node in reversed(graph.nodes):
        if node.name in claimed:
            continue
        for rule in rules:
            match = find_match(rule, node, program, users)
            if match is None:
                continue
            names = {n.name for n in match.interior} | {node.name}
            if names & claimed:
                continue
            chosen[node.name] = rule
            claimed |= names
            break
    if not chosen:
        return program, False
    rewriter = Rewriter(NameSource(graph, program.weights), {})
    redirect: dict[Value, Value] = {}
    out: list[Node] = []
    view = replace(graph)
    by_name = dict(graph.by_name)
    object.__setattr__(view, "_by_name", by_name)
    current = replace(program, graph=view)
    for node in graph.nodes:
        node = replace(node, args=tuple((k, map_values(a, redirect)) for k, a in node.args))
        by_name[node.name] = node
        chosen_rule = chosen.get(node.name)
        match = find_match(chosen_rule, node, current, users) if chosen_rule is not None else None
        result = (
            chosen_rule.replacement(match, rewriter)
            if chosen_rule is not None and match is not None
            else None
        )
        if result is None:
            out.append(node)
            continue
        new_nodes, mapping = result if isinstance(result, tuple) else (result, {})
        if not mapping:
            mapping = {node.value(): new_nodes[-1].value()}
        out.extend(new_nodes)
        by_name.update({n.name: n for n in new_nodes})
        redirect.update(mapping)
        assert chosen_rule is not None
        hits[chosen_rule.name] += 1
    if not redirect:
        return program, False
    outputs = tuple((name, redirect.get(value, value)) for name, value in graph.outputs)
    new_graph = eliminate_dead_code(replace(graph, nodes=tuple(out), outputs=outputs))
    weights = dict(program.weights) | rewriter.new_weights
    live = {str(n.arg("key")) for n in new_graph.nodes if n.op == "const"}
    return replace(
        program, graph=new_graph, weights={k: v for k, v in weights.items() if k in live}
    ), True
