"""A model file that forgets to define `model` (graphmem must say to add one: exit 2)."""
import torch.nn as nn

net = nn.Linear(4, 4)  # named `net`, not `model`
