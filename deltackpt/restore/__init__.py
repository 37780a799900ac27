"""A restore: matching a live state against a commit record, then filling it from the chain."""
