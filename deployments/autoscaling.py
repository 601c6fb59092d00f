"""Serve autoscaling policies for the model and ingress deployments (docs/user-guide/scaling.md).

Ray 2.60 lets a deployment name its own policy (``autoscaling_config.policy``: a class,
instantiated once with ``policy_kwargs``, called with an ``AutoscalingContext`` every
control-loop tick in Serve's controller) and lets its replicas report custom metrics
(a ``record_autoscaling_stats`` method, called every ``metrics_interval_s``; Serve averages
each over ``look_back_period_s`` and hands them to the policy as
``ctx.aggregated_metrics[name][replica_id]``). Serve then applies ``min_replicas`` /
``max_replicas`` and the up- and downscale delays to what the policy returns. Serve's own
signal, ongoing requests through deployment handles, would not see a model replica's load:
its requests arrive over the peer channel.

- ``ModelPolicy``: a model replica reports ``planned_replicas``, the count the tuner's plan
  gives its model (``tuning/scaling.py``: all models solved together from the live routing,
  step times and offered load, so their ratio follows the routing), and ``utilisation``, its
  mean rows per step against ``max_num_seqs``. The policy follows the plan, and never goes
  below what the replicas' load asks for, ``ceil(sum of utilisation / target)``: a model
  that saturates before its replicas arrive admits fewer requests than are offered (the
  ingress answers the rest 429), so the arrivals the plan is solved from understate the
  load exactly then. While no replica has a fresh plan (the tuner starting or restarting,
  too few statistics yet) it scales on that load alone.
- ``IngressPolicy``: an ingress replica reports ``active`` requests against
  ``max_active_requests``; the policy asks for ``ceil(sum of utilisation / target)``.

Why not Serve's application-level policy (``autoscaling_policy`` of an application, one call
for all deployments)? Ray 2.60 reads it only from a config file's application entry (a
``serve.run(app)`` cannot set it) and its schema still calls it "under development and not
yet supported"; and the joint model (a Markov-based plan) costs up to seconds to solve,
which belongs in the tuner's worker thread, not in the controller's 0.1 s loop. The models
are still scaled together: one plan, one source.

This module is pickled by value into Serve's controller (``AutoscalingPolicy``): it imports
nothing of this project's.
"""

from __future__ import annotations

import math
from typing import Any

PLANNED = "planned_replicas"
UTILISATION = "utilisation"
ACTIVE = "active"
MODEL_POLICY = "deployments.autoscaling:ModelPolicy"
INGRESS_POLICY = "deployments.autoscaling:IngressPolicy"


def _values(ctx: Any, name: str) -> list[float]:
    metrics = ctx.aggregated_metrics or {}
    return [float(v) for v in metrics.get(name, {}).values()]


def _by_load(ctx: Any, target: float) -> int:
    """Replicas for the summed utilisation at ``target`` each (the current count when no
    replica reported one)."""
    loads = _values(ctx, UTILISATION)
    if not loads:
        return ctx.target_num_replicas
    return max(1, math.ceil(sum(loads) / target - 1e-9))


class ModelPolicy:
    """A model deployment's policy (see the module docstring)."""

    def __init__(self, target_utilisation: float = 0.7) -> None:
        self.target = float(target_utilisation)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        by_load = _by_load(ctx, self.target)
        planned = [v for v in _values(ctx, PLANNED) if v >= 1]
        if not planned:
            return by_load, {"source": "utilisation"}
        # replicas that heard the plan at different times: the newest is the largest on the
        # way up (and the way down waits downscale_delay_s anyway)
        plan = round(max(planned))
        if by_load > plan:  # saturated: admitted arrivals understate the offered load
            return by_load, {"source": "utilisation"}
        return plan, {"source": "plan"}


class IngressPolicy:
    """The ingress deployment's policy (see the module docstring)."""

    def __init__(self, target_utilisation: float = 0.7) -> None:
        self.target = float(target_utilisation)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        return _by_load(ctx, self.target), {"source": "utilisation"}
