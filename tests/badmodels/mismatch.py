"""A shape mismatch inside nn.Linear: 8 features go into a layer that takes 16."""
import torch.nn as nn

model = nn.Sequential(nn.Linear(4, 8), nn.Linear(16, 2))
