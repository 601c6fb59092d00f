"""The chart's `serveFront`: Serve's Python proxy by default (no HAProxy variable anywhere);
`haproxy` sets RAY_SERVE_ENABLE_HA_PROXY=1 on every Ray container (the head and each worker
group), since Ray reads it where each node's front starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s import manifests
from tests.k8s.test_chart_api_keys import containers

Objects = list[dict[str, Any]]
HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"


def front_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in container.get("env", []) if e["name"] == HAPROXY]


def test_serves_python_proxy_by_default(default_render: Objects) -> None:
    assert manifests.default_values()["serveFront"] == "proxy"
    assert all(not front_env(c) for c in containers(default_render))


def test_haproxy_front_on_every_ray_container(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["serveFront"] = "haproxy"
    found = [front_env(c) for c in containers(render_values(values))]
    assert len(found) == 4  # the head, one worker group per model, the direct port's
    assert all(env == [{"name": HAPROXY, "value": "1"}] for env in found)


def test_an_unknown_front_is_refused(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["serveFront"] = "nginx"
    with pytest.raises(Exception, match="serveFront"):
        render_values(values)
