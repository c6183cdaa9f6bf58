"""pagedkv_lab: the library that the PagedKV Lab course builds, chapter by chapter.

Importing the package is cheap and never imports Triton, so that a notebook's
setup can still choose Triton's interpreter mode first.
"""

__version__ = "0.1.0"
