"""Checks that need an accelerator: ``python -m loadtest.device.gpu_check`` (the one prepared
run for a GPU machine, docs/deployment/gpu-check.md) and its flagship shapes (``gpu_flagship.py``).
``image_packages_*.txt``: the device image's package list the import test reads."""
