"""The served host path's targets, from the rows ``host_path.run_served`` measures, each
PASS / MISS (never a failure); docs/benchmarks/README.md, "Host path", lists them.
"""

from __future__ import annotations

from typing import Any

from loadtest.proc_cpu import FRONT, SUPPORT, SUPPORT_ACTORS, app_total_us

Target = tuple[str, bool, str]
IDEAL_GOAL = {8: 0.95, 32: 0.95, 64: 0.90}  # served / ideal, by N
CPU_APP_US, CPU_PROCESS_US = 150.0, 50.0  # at h200 N = 64
APPLIED_P50_US = 1000.0  # at N = 32
TTFT_OVERHEAD_MS = {"Serve's proxy": 8.0, "Serve's HAProxy ingress": 8.0, "the direct port": 3.0}


def via(system: str, front: str = "proxy") -> str:
    """The path a system's clients take: the ingress's own port, or Serve's front."""
    if system.endswith("direct"):
        return "the direct port"
    return "Serve's HAProxy ingress" if front == "haproxy" else "Serve's proxy"


def device_ms(profile: str, path: str) -> float:
    """The simulated device time on a probe's first-token ``path`` (``host_path``'s
    ``PROBE_ROUTING``): the entry model's step at batch 1 (its prefill), and for an
    escalated first token the large model's step at batch 1 too."""
    from tokenrouter_ray.simulation.served import profile_models

    models = profile_models(profile)
    steps = models[:2] if path == "escalated" else models[:1]
    return sum(m.step_time_ms(1) for m in steps)


def served_targets(served: list[dict[str, Any]]) -> list[Target]:
    out: list[Target] = []

    def at_most(name: str, value: float, bound: float) -> None:  # µs
        out.append((name, value <= bound, f"{value:.0f} µs"))

    def row_of(system: str, n: int) -> dict[str, Any] | None:
        return next((r for r in served if r["system"] == system and r["n"] == n), None)

    for r in served:
        if "same_as" in r:  # a tuned system whose table is all-1 here: that run's row
            continue
        system, n = r["system"], r["n"]
        if r.get("client", "stream") != "stream":  # named so the two workloads stay apart
            system = f"{system} ({r['client']} clients)"
        if r.get("front", "proxy") != "proxy" and not r["system"].endswith("direct"):
            system = f"{system} via {via(r['system'], r['front'])}"
        goal, pred = IDEAL_GOAL.get(n), r.get("predicted")
        if goal is not None and pred:
            ratio = r["tok_s"] / pred
            out.append((f"served {system} N={n}: served / ideal >= {goal:.2f}", ratio >= goal,
                        f"{ratio:.3f} ({r['tok_s']:.1f} of {pred:.1f} tok/s)"))  # fmt: skip
        cpu = r.get("cpu_us_per_token") or {}
        if r["profile"] == "h200" and n == 64 and cpu:
            at_most(f"served {system} N=64: app CPU per token <= {CPU_APP_US:.0f} µs",
                    app_total_us(cpu), CPU_APP_US)  # fmt: skip
            for name, us in cpu.items():  # the ingress and each model replica
                if name not in FRONT and name not in SUPPORT and name not in SUPPORT_ACTORS:
                    at_most(f"served {system} N=64: {name} CPU per token <= "
                            f"{CPU_PROCESS_US:.0f} µs", us, CPU_PROCESS_US)  # fmt: skip
        for model, m in r["models"].items() if n == 32 else ():
            if m.get("applied_p50_us") is not None:
                at_most(f"served {system} N=32 {model}: message applied p50 <= 1 ms",
                        m["applied_p50_us"], APPLIED_P50_US)  # fmt: skip
        if n == 1:
            out += _ttft_targets(system, r)
    for n in sorted({r["n"] for r in served}):
        for profile in sorted({r["profile"] for r in served}):
            proxied, direct = row_of(f"{profile} eager", n), row_of(f"{profile} eager direct", n)
            if proxied and direct:
                out.append((f"served {profile} N={n}: direct port >= Serve's proxy (tok/s)",
                            direct["tok_s"] >= proxied["tok_s"],
                            f"{direct['tok_s']:.1f} vs {proxied['tok_s']:.1f} tok/s"))  # fmt: skip
            for suffix in ("", " direct"):
                eager, tuned = (row_of(f"{profile} {k}{suffix}", n) for k in ("eager", "tuned"))
                if eager and tuned and n in (8, 32):
                    ratio = tuned["tok_s"] / eager["tok_s"]
                    model = tuned["predicted"] / eager["predicted"]
                    out.append((f"served {profile} N={n}: tuned >= all-ones ({via(suffix)})",
                                ratio >= 1.0, f"{ratio:.3f}x (B={tuned['thresholds']}; ideal "
                                f"{model:.3f})"))  # fmt: skip
        for model, m in (row_of("zero", n) or {}).get("models", {}).items():
            host = {**(m.get("host_us") or {}), "rows": m.get("rows", 0)}
            out.append(critical_target(f"served zero N={n} {model}", host))
    return out


def critical_target(where: str, host_us: dict[str, float]) -> Target:
    """The zero profile's critical host path per step: <= 0.3 ms + 10 µs per sampled row."""
    bound, crit = 300 + 10 * host_us.get("rows", 0), host_us.get("critical", 0.0)
    return (
        f"{where}: critical host <= 0.3 ms + 10 µs/row",
        crit <= bound,
        f"{crit:.0f} µs vs {bound:.0f}",
    )


def _ttft_targets(system: str, r: dict[str, Any]) -> list[Target]:
    """TTFT overhead at N = 1 for each first-token path the probe measured (a row without
    paths: the policy's mix, read as a kept first token)."""
    paths = r.get("ttft_probe_paths_ms_p50") or {}
    mixed = paths.get("mixed", r.get("ttft_probe_ms_p50"))
    measured = {k: paths[k] for k in ("kept", "escalated") if k in paths} or {"kept": mixed}
    by_httpx = r.get("ttft_probe_httpx_paths_ms_p50") or {}
    path_name = via(r["system"], r.get("front", "proxy"))
    bound = TTFT_OVERHEAD_MS[path_name]
    out: list[Target] = []
    for path, probe in measured.items():
        if probe is None:
            continue
        device = device_ms(r["profile"], path)
        overhead = probe - device
        beside = f"; the policy's mix {mixed:.1f} ms" if paths and mixed is not None else ""
        if by_httpx.get(path) is not None:  # the same path through httpx: its client's own
            beside += f"; through httpx {by_httpx[path]:.1f} ms in all"
        out.append((
            f"served {system}: TTFT overhead, first token {path}, <= {bound:g} ms ({path_name}; "
            "the first token's bytes minus the simulated device time, one request at a time)",
            overhead <= bound,
            f"{overhead:.1f} ms ({probe:.1f} ms in all, {device:.1f} simulated{beside})",
        ))  # fmt: skip
    return out
