"""The store format: keys and layout, zarr v3 metadata, the commit record, dtypes and encodings."""
