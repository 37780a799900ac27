"""Operations on a whole store beside saving and restoring: the writer lease, compaction, garbage
collection, verification, export and import."""
