"""The ingress process: the OpenAI HTTP app, the request core that submits requests to the
models and assembles their commits, admission, backpressure, replica placement, recovery from
a lost replica, and the direct HTTP port. Nothing here runs on a model replica; the Ray Serve
deployment that hosts it is ``deployments/ingress.py``."""
