"""What to change so a step fits: levers (checkpoint plans, the loss, attention, precision, the
optimizer, micro-batches, sharding, LoRA), each measured by a capture of the changed step, ranked
by cost (docs/advise.md)."""
from graphmem.advise.advise import Advice, Lever, advise
from graphmem.advise.levers import LeftOut

__all__ = ["Advice", "Lever", "LeftOut", "advise"]
