"""tokenrouter-ray: token-level LLM routing served on Ray Serve.

The engine, policies, protocol and tuner live here and run without Ray; the Ray Serve
glue lives in the top-level package ``deployments``.
"""

from __future__ import annotations

__version__ = "0.1.0"
