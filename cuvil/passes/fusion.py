"""The fusion passes: each applies one family of rule sets to a fixpoint."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from cuvil.backends.base import Lowering
from cuvil.passes.program import Program
from cuvil.passes.rewrite import apply_rules
from cuvil.passes.rules_attention_bias import rules_attention_bias
from cuvil.passes.rules_epilogue import epilogue_rules
from cuvil.passes.rules_fold import rules_addmm, rules_fold_batch_norm
from cuvil.passes.rules_matmul import rules_matmul
from cuvil.passes.rules_norms import rules_layer_norm, rules_rms_norm, rules_rope, rules_swiglu
from cuvil.passes.rules_transformer import rules_attention, rules_gelu

rules_transformer = (
    rules_attention
    + rules_attention_bias
    + rules_layer_norm
    + rules_rms_norm
    + rules_swiglu
    + rules_rope
)


def canonicalize_activations(program: Program) -> Program:
    """Before CSE, which would share the ``x * 0.5`` of two GELUs and hide both patterns."""
    return apply_rules(program, rules_gelu)


def fold_batch_norm(program: Program) -> Program:
    """BatchNorm into the layer before it; a constant-weight addmm or matmul into a linear
    first (with the bias added after it)."""
    return apply_rules(program, rules_addmm + rules_matmul + rules_fold_batch_norm)


def fuse_transformer_blocks(program: Program) -> Program:
    return apply_rules(program, rules_transformer)


def epilogue_pass(lowering: Lowering) -> Callable[[Program], Program]:
    """The epilogue fusion a backend's kernels take (its ``Lowering``'s epilogue shapes)."""
    rules = epilogue_rules(lowering.conv_epilogues, lowering.linear_epilogues)
    return partial(apply_rules, rules=rules)
