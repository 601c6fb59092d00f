"""Model sub-servers and the runtimes that wire them: in one process (``LocalRuntime``) or
as Ray Serve deployments (``deployments/``), over any ``PeerChannel``."""
