"""torchtitan jobs as they are configured: rank r's step built and run by the job's own code on
fake tensors (graphmem/titan/capture.py), from its config (graphmem/titan/job.py)."""
from graphmem.titan.job import is_job_config, load_job, prepared, with_sdpa

__all__ = ["is_job_config", "load_job", "prepared", "with_sdpa"]
