"""A save, phase by phase: plan, scan, decide, stage, write, commit."""
