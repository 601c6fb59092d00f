"""Kept so ``python -m loadtest.gpu_check`` (older notes, device commands) still runs the
device check; it lives in loadtest/device/gpu_check.py."""

from __future__ import annotations

import sys

from loadtest.device.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
