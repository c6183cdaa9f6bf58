"""sim: see pagedkv_lab/__init__.py."""
