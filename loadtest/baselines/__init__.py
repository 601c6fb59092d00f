"""The systems the comparison measures tokenrouter against, each an OpenAI-style chat server
(``api.py``, shared): Step-Sync and one model alone (``step_sync.py``), and stock servers
(``stock.py``) glued by a per-token dispatcher (``dispatcher.py``)."""
