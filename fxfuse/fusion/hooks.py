"""A module's hooks, which Module.__call__ runs and a fused op would not: the tracer, the
passes and the regions all ask the same questions of them."""

from __future__ import annotations

from typing import Optional

from torch import nn


def has_hooks(m: nn.Module) -> bool:
    """Whether `m` has module hooks that Module.__call__ runs (forward pre, forward, backward pre, backward)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def describe_hooks(m: nn.Module) -> str:
    """`m`'s hooks in words: "a forward hook", "forward pre and full backward hooks"."""
    by_kind = {
        "forward pre": m._forward_pre_hooks,
        "forward": m._forward_hooks,
        "backward pre": m._backward_pre_hooks,
        "full backward" if m._is_full_backward_hook else "backward": m._backward_hooks,
    }
    kinds = [kind for kind, hooks in by_kind.items() if hooks]
    if sum(map(len, by_kind.values())) == 1:
        return f"a {kinds[0]} hook"
    return f"{' and '.join(kinds)} hooks"


def hooks_problem(m: nn.Module, what: str) -> Optional[str]:
    """Why module `m` must stay a module call for its hooks (None if it has none)."""
    if not has_hooks(m):
        return None
    return f"the {what} module has {describe_hooks(m)}; kept as a module call so that its hooks fire as in eager"
