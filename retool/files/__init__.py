"""Files on disk: the run folder's layout, the Parquet contract, atomic writes."""
