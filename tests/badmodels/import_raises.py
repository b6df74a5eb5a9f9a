"""A model file whose import raises (graphmem must say the import failed: exit 2)."""
import torch.nn as nn

raise RuntimeError("boom while building the model")

model = nn.Linear(4, 4)  # never reached
