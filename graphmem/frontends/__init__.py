"""What a user hands graphmem, turned into a StepSpec: the front door, ``door.spec_for``, which recognizes
each kind of subject; ``trainer`` (a Hugging Face Trainer or its TrainingArguments) and ``titan_job`` (a
torchtitan job). A plain module, an HF id or config and an exported program go through
graphmem/step/spec.py ``make_spec`` (which loads them with graphmem/capture/load.py)."""
