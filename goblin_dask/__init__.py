"""goblin-dask: verified scientific computing on volunteer machines."""
