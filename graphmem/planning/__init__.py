"""Activation checkpoint plans: chain costs measured from captures (costs.py), the planner over
passes/checkpoint_program.py's program (planner.py), selective op-level levels (selective.py), and
applying a plan with real torch.utils.checkpoint (apply.py).

>>> from graphmem.planning import apply_segments, OpPolicy   # what plan.code() prints
"""
from graphmem.planning.apply import Applied, apply_segments, chain_blocks
from graphmem.planning.costs import PlanError
from graphmem.planning.planner import CheckpointPlan, Planner, PlanSummary
from graphmem.planning.selective import OpPolicy

__all__ = ["Applied", "apply_segments", "chain_blocks", "PlanError", "CheckpointPlan", "Planner", "PlanSummary",
           "OpPolicy"]
