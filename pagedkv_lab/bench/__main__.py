"""`python -m pagedkv_lab.bench`."""

from .cli import main

main()
