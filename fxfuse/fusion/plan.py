"""What `optimize` applies: the user's options and the policy's choice (a `Plan`), by name.

A Plan names what to rewrite rather than pointing at graph nodes, so the same plan applies to
every graph built from the model: the captured one, the other train/eval mode's, and those a
call traces later (hooks or training flags changed). Names are module paths (or
`scope:function` for functional calls), as in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# What users pass as mode=: the passes see "memory" or "fast" (Options.pass_mode).
MODES = ("memory", "fast", "auto")


@dataclass(frozen=True)
class Plan:
    sites: Optional[frozenset] = None  # names of the sites the passes may rewrite (None: every site)
    regions: tuple = ()  # groups of region names (fusion/regions/graph.py) to recompute, in graph order
    flat_links: frozenset = frozenset()  # (first, second) links of those groups run as one region

    def scoped(self, path: str) -> Plan:
        """This plan for the submodule at `path`: what lies under it, with names relative to it."""
        if self.sites is None or not path:
            return self
        return Plan(
            None if self.sites is None else frozenset(_scoped_names(self.sites, path)),
            tuple(_scoped_names(self.regions, path)),
            frozenset(_scoped_names(self.flat_links, path)),
        )


@dataclass
class Options:
    mode: str = "memory"  # what the user asked for: "memory", "fast" or "auto"
    plan: Plan = field(default_factory=Plan)
    memory_budget: Optional[float] = None
    channels_last: bool = False  # the forward converts 4-D floating inputs to channels_last (fusion.layout)

    @property
    def pass_mode(self) -> str:
        """The passes' mode: auto and budgets pick among the sites of mode="memory"."""
        return "fast" if self.mode == "fast" else "memory"

    def scoped(self, path: str) -> Options:
        """These options for the submodule at `path` (names relative to it)."""
        plan = self.plan.scoped(path)
        if plan is self.plan:
            return self
        return Options(self.mode, plan, self.memory_budget, self.channels_last)


def _scoped_names(name_tuples, path: str) -> list[tuple[str, ...]]:
    """The tuples of `name_tuples` whose names all lie under `path`, relative to it, in order."""
    inner = (tuple(_unprefix(n, path) for n in names) for names in name_tuples)
    return [names for names in inner if all(n is not None for n in names)]


def _unprefix(name: str, path: str) -> Optional[str]:
    if name.startswith(path + "."):
        return name[len(path) + 1 :]
    if name.startswith(path + ":"):
        return name[len(path) :]
    return None
