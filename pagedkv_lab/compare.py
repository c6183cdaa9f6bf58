"""Moved: the comparison of outputs across systems is `pagedkv_lab.bench.compare`."""

raise ImportError(
    "pagedkv_lab.compare moved to pagedkv_lab.bench.compare "
    "(from pagedkv_lab.bench.compare import compare_systems)"
)
