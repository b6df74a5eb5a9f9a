"""What a user hands graphmem, turned into a StepSpec: ``trainer`` (a Hugging Face Trainer or its
TrainingArguments) and ``titan_job`` (a torchtitan job). A plain module, an HF id or config and an
exported program are read by graphmem/capture/load.py and graphmem/api.py."""
