"""The demos, run as ``python -m distgrad.demo [--engine E] [--check]`` (``__main__.py``).

``models.py`` builds the demos' models (the tests and benchmarks build theirs from it too);
``local.py``, ``data_parallel.py``, ``tensor_parallel.py`` and ``pipeline.py`` are one demo each;
``ranks.py`` holds what the multi-process demos share (device, process group, engine, teardown).
"""
