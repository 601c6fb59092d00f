"""The real runtime on simulated models: capacity planning and checks of the throughput model.

``backend`` is a model backend that computes nothing (``SimRunner`` sleeps for a profiled
step time) under the production engine, scheduler, model replicas and protocol, wired by
``LocalRuntime``; ``ClosedLoop`` and ``measure_closed_loop`` drive it. ``validate`` sweeps
thresholds on it and sets the measured throughput beside the Markov model's prediction
(``loadtest/markov_validate.py``), and also measures the tuned thresholds closed loop,
open loop (Poisson arrivals) and under a stepped client count against their predictions
(``loadtest/markov_open_loop.py``); ``commands`` is the ``tokenrouter-ray simulate`` CLI.
The throughput model itself lives in ``tuning``; this package only measures.
"""
