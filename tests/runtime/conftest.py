"""Runtime tests use the routing tests' tiny model chain (with the word-level tokenizer)."""

from tests.routing.conftest import served_chain_dirs  # noqa: F401  (fixture)
