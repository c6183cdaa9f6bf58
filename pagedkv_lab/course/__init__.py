"""course: see pagedkv_lab/__init__.py."""
