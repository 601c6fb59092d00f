"""A model replica: the step thread that drives one engine under a routing policy, the event
loop's mailbox between it and the peer channel, the messages it sends, the per-request routing
state it keeps and what it reports about itself. Nothing here runs in the ingress; the Ray
Serve deployment that hosts it is ``deployments/model_server.py``."""
