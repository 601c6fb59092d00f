"""Answer quality of a served system: task sets, scorers, and the ``eval`` command.

Task items (`tasks.py`, built-in ones in `builtin.py`) go to an OpenAI-compatible server
(`evaluate.py`); each response is scored (`scorers.py`) and summed into a `SystemResult`
with a Wilson interval (`stats.py`) and the routing extension's token counts.
"""
