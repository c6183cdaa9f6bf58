"""Course scaffolding: what the chapters draw and show, not what the library runs."""
