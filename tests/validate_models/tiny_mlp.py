"""A small MLP with LayerNorm and dropout; default inputs (float32) and the default loss."""
from graphmem.models import mlp

model = mlp.build(mlp.MLPConfig(in_features=64, hidden=(128, 128), out_features=10, activation="gelu",
                                dropout=0.1, layernorm=True))
