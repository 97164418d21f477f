"""Recompute regions: runs of graph nodes that keep only their inputs and run again in backward.

    ranking     one ranking of everything that trades recompute for memory (site upgrades,
                regions, links), and what a prefix of it selects
    costs       each region's recompute FLOPs and bytes freed, from one meta-device forward
    graph       regions found in a fused graph; the chosen ones (and chains of them) compiled
                into one call each
    recompute   that call at run time: checkpointed, the region's buffers swapped for copies
    checkpointed  non-reentrant checkpoint at half torch.utils.checkpoint's host cost (torch's own
                where transforms, modes or saved-tensor hooks are active)

The policy (fusion/policy.py) chooses among them through `ranking`; the plan it returns names the
chosen regions (fusion/plan.py), and fusion/apply.py rewrites them through `graph`.
"""
