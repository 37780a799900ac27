"""Moving bytes: the chunk writer (with a delta's packs), the chain reader and the staging pool."""
