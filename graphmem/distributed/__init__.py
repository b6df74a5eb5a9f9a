"""Per-rank steps under torch.distributed's own parallel wrappers, run on a fake process group."""
