"""The benchmarks: ``python -m loadtest`` (``__main__.py``) runs the paper's comparison by
preset or any benchmark by name (``python -m loadtest list``; docs/benchmarks/README.md lists them
with their commands). ``common.py`` is what the benchmarks share, ``harness.py`` the load
generator; each other module is one benchmark or one part of the comparison (``run.py``,
``systems.py``, ``report.py``, ``quality.py``, ``prediction.py``, ``workloads.py``) or of the
host path (``host_targets.py``, ``proc_cpu.py``, ``raw_http.py``); ``baselines/`` are the
systems it compares against, ``device/`` the checks for a GPU."""
