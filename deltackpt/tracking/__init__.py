"""Change detection: content hashes, marks from embedding lookups, and the canary that checks them."""
