"""nbval settings for the chapter notebooks.

stderr is not compared (library warnings vary with versions; chapters keep it
quiet anyway), nor are images and widget views (compared through the numbers
that produce them, which cells print).
"""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += (
            "stderr",
            "image/png",
            "image/svg+xml",
            "application/vnd.jupyter.widget-view+json",
        )
