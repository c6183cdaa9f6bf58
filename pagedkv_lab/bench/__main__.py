"""`python -m pagedkv_lab.bench`."""

from pagedkv_lab.bench.cli import main

main()
