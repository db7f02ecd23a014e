"""``python -m goblin_dask.volunteer ARGV...``: what ``goblin volunteer ARGV...`` does (the lab's tests and
``--gpus`` start volunteers this way, without the ``goblin`` entry point on PATH)."""

import sys

from goblin_dask.volunteer.command import main

main(sys.argv[1:])
